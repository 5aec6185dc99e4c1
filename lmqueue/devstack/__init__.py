"""Local process helpers: what the demo, the benchmarks and the tests start on one machine.

redis      LocalRedis: a private redis-server on a free loopback port; free_port;
           CACHE_POLICY, the cache role's eviction policy
cluster    LocalCluster: a private Redis Cluster, with the faults the cluster tests inject
process    ChildProcess: a command as a child process, its output in a log file
workers    WorkerProcess: ``python -m lmqueue.workers`` as a child process; wait_live
scheduler  SchedulerProcess: ``python -m lmqueue.scheduler`` as a child process
stop       stop_process (SIGTERM, a grace period, SIGKILL) and kill_process (a crash): how
           every one of them ends
"""

from .cluster import ClusterNode, LocalCluster
from .process import ChildProcess, child_environment
from .redis import CACHE_POLICY, LocalRedis, free_port
from .scheduler import SchedulerProcess
from .stop import kill_process, stop_process
from .workers import WorkerProcess, wait_live

__all__ = [
    "CACHE_POLICY",
    "ChildProcess",
    "ClusterNode",
    "LocalCluster",
    "LocalRedis",
    "SchedulerProcess",
    "WorkerProcess",
    "child_environment",
    "free_port",
    "kill_process",
    "stop_process",
    "wait_live",
]

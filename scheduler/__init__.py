"""The experiment scheduler: arq worker processes that run tenants' experiments.

settings      SchedulerSettings, CronEntry (flags and a JSON file)
worker        the arq worker: msgpack jobs, the experiment function, cron jobs
dispatcher    tenants' inbox streams -> arq jobs (tenant from the stream)
run           one start of one experiment: limit, leases, cancel, final status
context       what a kind sees: checkpoint (rows + resume state, atomic), progress
limits        the per-tenant running limit (leases in a zset)
kinds         score, sample, smc, and custom "module:function" kinds
smc_sampler   the SMC sampler of the smc kind (numpy; the demo and benchmarks run it too)
acl           the ACL rules a tenant needs for its experiments
serialization arq's msgpack job serializer
"""

from .acl import experiment_acl_rules
from .arq_worker import build_worker, serve
from .settings import CronEntry, SchedulerSettings

__all__ = ["SchedulerSettings", "CronEntry", "build_worker", "serve", "experiment_acl_rules"]

"""`lmq tenant` on a Redis Cluster makes each user on every node, replicas included.

Found by ``lmq bench soak --cluster``: on a new cluster (tenants are made before any data),
``CLUSTER SLOTS`` lists no replica, so redis-py's "all nodes" were the masters only; the
first failover promoted a replica without the tenants' and the workers' users, and every
client and worker was refused from then on.
"""

from __future__ import annotations

import pytest
import redis

from lmqueue.devstack import LocalCluster
from lmqueue.shared.connections import sync_redis
from lmqueue.shared.tenants import WORKER_USER, TenantConfig
from lmqueue.tenant_admin import TenantAdmin

pytestmark = pytest.mark.cluster


def test_users_reach_the_replicas_of_a_new_cluster_and_survive_a_failover() -> None:
    with LocalCluster(acl_files=True) as cluster:
        admin = sync_redis(cluster.url)
        try:
            tenants = TenantAdmin(admin, cluster.url)
            tenants.add(TenantConfig("carol"))
            tenants.worker_user()
        finally:
            admin.close()
        for node in cluster.nodes:
            with redis.Redis(port=node.port) as client:
                users = {u.decode() for u in client.execute_command("ACL", "USERS")}
            assert {"carol", WORKER_USER} <= users, (node.port, users)
        killed = cluster.master_ports()[0]
        cluster.kill_master(killed)
        cluster.restart(killed)  # back as a replica, its users read from its ACL file
        for port in cluster.master_ports():
            with redis.Redis(port=port) as client:
                assert b"carol" in client.execute_command("ACL", "USERS"), port
        with redis.Redis(port=killed) as client:
            assert b"carol" in client.execute_command("ACL", "USERS")

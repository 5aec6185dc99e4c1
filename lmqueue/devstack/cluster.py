"""`LocalCluster`: a private Redis Cluster on free loopback ports, for tests and benchmarks.

Three masters with one replica each by default, no persistence (``--save '' --appendonly
no``), a short node timeout so that a killed master's replica is promoted in about two
seconds. `kill_master_of`/`kill_master` and `migrate_slot` are the faults the cluster tests
inject; `restart` and `promote` put a killed master back where it was, so one cluster can take
many failovers in a row. Given a
certificate and key (`tls`), the nodes speak only TLS, to clients and on the cluster bus.
"""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import redis

from .stop import kill_process, stop_process

__all__ = ["LocalCluster", "ClusterNode"]


def _free_node_port() -> int:
    """A free port P whose cluster-bus port P + 10000 is free too."""
    for _ in range(200):
        port = random.randint(20_000, 50_000)
        if _free(port) and _free(port + 10_000):
            return port
    raise RuntimeError("no free pair of ports for a cluster node")


def _free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@dataclass
class ClusterNode:
    """One redis-server process of the cluster."""

    port: int
    process: subprocess.Popen[bytes] | None = None

    @property
    def alive(self) -> bool:
        """Whether the process runs."""
        return self.process is not None and self.process.poll() is None


class LocalCluster:
    """A Redis Cluster of `masters` masters with `replicas` replicas each, on 127.0.0.1.

    Args:
        node_timeout_ms: ``cluster-node-timeout``: how long a master may be silent before its
            replica takes over.
        maxmemory: each node's ``maxmemory`` (0: unbounded).
        tls: (certificate, key) PEM files: TLS only, the certificate is also the CA clients
            verify the nodes with (``rediss://`` URLs).
        acl_files: give each node an ACL file of its own (the default user as usual), so
            users made with ``ACL SETUSER`` and saved (``ACL SAVE``, as ``lmq tenant`` does)
            outlive a node's restart, as in a deployment.
    """

    def __init__(
        self,
        masters: int = 3,
        replicas: int = 1,
        node_timeout_ms: int = 1000,
        maxmemory: str = "0",
        tls: tuple[Path, Path] | None = None,
        acl_files: bool = False,
    ) -> None:
        for tool in ("redis-server", "redis-cli"):
            if shutil.which(tool) is None:
                raise RuntimeError(f"{tool} is not installed (apt-get install redis-server)")
        self.masters = masters
        self.replicas = replicas
        self.node_timeout_ms = node_timeout_ms
        self.maxmemory = maxmemory
        self.tls = tls
        self.acl_files = acl_files
        self.nodes = [ClusterNode(_free_node_port()) for _ in range(masters * (1 + replicas))]
        self._dir = Path(tempfile.mkdtemp(prefix="lmq-cluster-"))

    @property
    def url(self) -> str:
        """The redis:// URL of one live node (any node serves as the entry point)."""
        return self.url_of(next(n for n in self.nodes if n.alive).port)

    def url_of(self, port: int) -> str:
        """The URL naming the node on `port`."""
        if self.tls is None:
            return f"redis://127.0.0.1:{port}/0"
        query = f"ssl_ca_certs={self.tls[0]}&ssl_check_hostname=true"
        return f"rediss://127.0.0.1:{port}/0?{query}"

    def start(self, timeout_s: float = 30.0) -> LocalCluster:
        """Start every node, join them into a cluster, wait for ``cluster_state:ok``."""
        try:
            for node in self.nodes:
                self._spawn(node)
            for node in self.nodes:
                self._wait_listening(node, timeout_s)
            addresses = [f"127.0.0.1:{node.port}" for node in self.nodes]
            subprocess.run(
                ["redis-cli", *self._cli_tls(), "--cluster", "create", *addresses,
                 "--cluster-replicas", str(self.replicas), "--cluster-yes"],
                check=True, capture_output=True, timeout=timeout_s,
            )  # fmt: skip
            self.wait_ok(timeout_s)
            self.wait_replicated(timeout_s)
        except BaseException:
            self.close()
            raise
        return self

    def _wait_listening(self, node: ClusterNode, timeout_s: float, tries: int = 3) -> None:
        """Wait until a new node answers; one that exited (another process took its port
        since `_free_node_port` looked: seen on a busy shared machine) moves to a new port."""
        for attempt in range(tries):
            try:
                self._wait_ping(node, timeout_s)
                return
            except RuntimeError:
                if node.alive or attempt == tries - 1:
                    raise
            node.port = _free_node_port()
            self._spawn(node)

    def _spawn(self, node: ClusterNode) -> None:
        log = self._dir / f"redis-{node.port}.log"
        acl: list[str] = []
        if self.acl_files:
            path = self._dir / f"users-{node.port}.acl"
            if not path.exists():
                path.write_text("user default on nopass ~* &* +@all\n")
            acl = ["--aclfile", str(path)]
        node.process = subprocess.Popen(
            ["redis-server", "--bind", "127.0.0.1", *self._listen(node.port),
             "--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{node.port}.conf",
             "--cluster-node-timeout", str(self.node_timeout_ms),
             "--save", "", "--appendonly", "no", "--repl-diskless-sync-delay", "0",
             "--dir", str(self._dir),
             "--maxmemory", self.maxmemory, "--logfile", str(log), *acl],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip

    def _listen(self, port: int) -> list[str]:
        if self.tls is None:
            return ["--port", str(port)]
        cert, key = (str(path) for path in self.tls)
        return ["--port", "0", "--tls-port", str(port), "--tls-cluster", "yes",
                "--tls-replication", "yes", "--tls-cert-file", cert, "--tls-key-file", key,
                "--tls-ca-cert-file", cert, "--tls-auth-clients", "no"]  # fmt: skip

    def _cli_tls(self) -> list[str]:
        return [] if self.tls is None else ["--tls", "--cacert", str(self.tls[0])]

    def _client(self, port: int) -> redis.Redis:
        return redis.Redis(
            host="127.0.0.1", port=port, socket_timeout=5, socket_connect_timeout=1,
            ssl=self.tls is not None, ssl_ca_certs=None if self.tls is None else str(self.tls[0]),
        )  # fmt: skip

    def _wait_ping(self, node: ClusterNode, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not node.alive:
                raise RuntimeError(f"cluster node {node.port} exited (see {self._dir})")
            try:
                with self._client(node.port) as client:
                    if client.ping():
                        return
            except redis.RedisError:
                time.sleep(0.05)
        raise RuntimeError(f"cluster node {node.port} did not answer in {timeout_s} s")

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Wait until every live node reports ``cluster_state:ok`` and agrees on the masters."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._all_ok():
                return
            time.sleep(0.1)
        raise RuntimeError(f"the cluster did not reach cluster_state:ok in {timeout_s} s")

    def wait_replicated(self, timeout_s: float = 30.0) -> None:
        """Wait until every master has `replicas` replicas in sync (``state=online``)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                ports = self.master_ports()
                if all(self._online_replicas(port) >= self.replicas for port in ports):
                    return
            except redis.RedisError:  # a node that has just (re)started may still be loading
                pass
            time.sleep(0.1)
        raise RuntimeError(f"the replicas did not sync in {timeout_s} s")

    def _online_replicas(self, port: int) -> int:
        with self._client(port) as client:
            info = client.info("replication")
        return sum(
            1
            for name, value in info.items()
            if name.startswith("slave")
            and isinstance(value, dict)
            and value.get("state") == "online"
        )

    def _all_ok(self) -> bool:
        views = set()
        for node in self.nodes:
            if not node.alive:
                continue
            try:
                with self._client(node.port) as client:
                    info = client.cluster("info")
                    if info.get("cluster_state") != "ok":
                        return False
                    views.add(tuple(sorted(self._masters_seen_by(client))))
            except redis.RedisError:
                return False
        return len(views) == 1

    @staticmethod
    def _masters_seen_by(client: redis.Redis) -> list[int]:
        raw = client.execute_command("CLUSTER", "NODES")
        text = raw.decode() if isinstance(raw, bytes) else raw
        ports = []
        for line in text.splitlines():
            parts = line.split()
            if "master" in parts[2] and "fail" not in parts[2] and len(parts) > 8:
                ports.append(int(parts[1].split(":")[1].split("@")[0]))
        return ports

    def master_ports(self) -> list[int]:
        """Ports of the masters that own slots, as a live node sees them."""
        node = next(n for n in self.nodes if n.alive)
        with self._client(node.port) as client:
            return sorted(self._masters_seen_by(client))

    def node_id(self, port: int) -> str:
        """The cluster node id of the node on `port`."""
        with self._client(port) as client:
            return str(client.execute_command("CLUSTER", "MYID").decode())

    def port_of_slot(self, slot: int) -> int:
        """The port of the master that serves `slot`."""
        node = next(n for n in self.nodes if n.alive)
        with self._client(node.port) as client:
            for start, end, master, *_ in client.execute_command("CLUSTER", "SLOTS"):
                if int(start) <= slot <= int(end):
                    return int(master[1])
        raise LookupError(f"slot {slot} is not served")

    @staticmethod
    def slot_of(key: str) -> int:
        """The hash slot of `key` (hash tags honoured)."""
        from redis.crc import key_slot

        return int(key_slot(key.encode()))

    def flush(self) -> None:
        """Delete every key on every master (replicas follow)."""
        for port in self.master_ports():
            with self._client(port) as client:
                client.flushall()

    def kill_master_of(self, key: str, timeout_s: float = 30.0) -> int:
        """SIGKILL the master serving `key`; wait until its replica serves instead.

        Returns:
            The port of the killed node.
        """
        port = self.port_of_slot(self.slot_of(key))
        self.kill_master(port, timeout_s)
        return port

    def kill_master(self, port: int, timeout_s: float = 30.0) -> None:
        """SIGKILL the master on `port`; wait until a replica serves its slots, all nodes agree."""
        slots = self._slots_of(port)
        node = next(n for n in self.nodes if n.port == port)
        assert node.process is not None and slots, f"{port} is not a live master"
        kill_process(node.process)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if self.port_of_slot(slots[0]) != port and self._all_ok():
                    return
            except (redis.RedisError, LookupError):
                pass
            time.sleep(0.1)
        raise RuntimeError(f"no replica took over from the killed master {port}")

    def _slots_of(self, port: int) -> list[int]:
        """The first slot of each range the master on `port` serves."""
        node = next(n for n in self.nodes if n.alive)
        with self._client(node.port) as client:
            ranges = client.execute_command("CLUSTER", "SLOTS")
        return [int(start) for start, _end, master, *_ in ranges if int(master[1]) == port]

    def restart(self, port: int, timeout_s: float = 30.0) -> None:
        """Start the killed node on `port` again: it rejoins as a replica (its data is gone)."""
        node = next(n for n in self.nodes if n.port == port)
        if node.alive:
            raise RuntimeError(f"cluster node {port} is running")
        self._spawn(node)
        self._wait_ping(node, timeout_s)
        self.wait_ok(timeout_s)
        self.wait_replicated(timeout_s)

    def promote(self, port: int, timeout_s: float = 30.0) -> None:
        """Make the replica on `port` its master's master again (``CLUSTER FAILOVER``, no loss)."""
        deadline = time.monotonic() + timeout_s
        while True:  # a node that has just rejoined may still be loading its master's data
            try:
                with self._client(port) as client:
                    client.execute_command("CLUSTER", "FAILOVER")
                break
            except redis.RedisError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        while time.monotonic() < deadline:
            if port in self.master_ports() and self._all_ok():
                self.wait_replicated(timeout_s)
                return
            time.sleep(0.1)
        raise RuntimeError(f"the replica on {port} did not take over in {timeout_s} s")

    def migrate_slot(self, slot: int, to_port: int, pause_s: float = 0.0) -> int:
        """Move `slot` and its keys to the master on `to_port` (CLUSTER SETSLOT + MIGRATE).

        Between marking the slot migrating and moving its keys the method sleeps `pause_s`,
        so clients meet ASK redirects meanwhile. Returns the number of keys moved.
        """
        from_port = self.port_of_slot(slot)
        if from_port == to_port:
            return 0
        source, target = self._client(from_port), self._client(to_port)
        source_id, target_id = self.node_id(from_port), self.node_id(to_port)
        moved = 0
        try:
            target.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", source_id)
            source.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
            time.sleep(pause_s)
            while keys := source.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100):
                source.execute_command("MIGRATE", "127.0.0.1", to_port, "", 0, 5000, "KEYS", *keys)
                moved += len(keys)
            for port in self.master_ports():
                with self._client(port) as client:
                    client.execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)
        finally:
            source.close()
            target.close()
        return moved

    def stop(self) -> None:
        """Stop every node (SIGTERM, then SIGKILL after 5 s)."""
        for node in self.nodes:
            stop_process(node.process, grace_s=5)
            node.process = None

    def close(self) -> None:
        """Stop every node and remove the cluster's directory."""
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

"""The soak's fault schedule: every ``every_s`` seconds the next fault of a fixed rotation.

Kinds (each a blocking function of the `Rig`, run off the event loop; it returns when the
fault is over and the system is whole again, which is the fault's *repair* time):

* ``kill_worker``: SIGKILL a worker mid-work and start it again at once (as a supervisor
  would), under the same name; over when its heartbeat is back. Its unacknowledged entries
  are reclaimed by the other worker after the claim timeout, or finished by itself.
* ``restart_redis``: SIGKILL the queue Redis and start it again on the same port, reloading
  its AOF (``appendfsync everysec``: the last second of writes may be gone, which clients
  notice by the server's new run id and send again); over when it answers PING.
* ``restart_client``: SIGKILL a tenant's client process mid-program and start it again; its
  begun calls are abandoned with it, the new process starts new programs.
* ``stop_worker``: SIGSTOP a worker for twice the claim timeout, then SIGCONT: the other
  worker reclaims its entries; the thawed one's late replies are dropped by the clients.
* ``kill_master`` (``--cluster``, in place of ``restart_redis``): SIGKILL a master of the
  queue cluster; its replica is promoted. The killed node is started again and rejoins as a
  replica, so the next kill finds a replica everywhere.

Workers (a turn per kind) and clients are picked in turn, so each is hit by each fault.
"""

from __future__ import annotations

import itertools
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

from .rig import Rig

__all__ = ["FaultEvent", "FaultSchedule", "KINDS", "CLUSTER_KINDS"]

KINDS = ("kill_worker", "restart_redis", "restart_client", "stop_worker")
CLUSTER_KINDS = ("kill_worker", "kill_master", "restart_client", "stop_worker")


@dataclass
class FaultEvent:
    """One fault: what, on whom, when it began (wall clock) and how long until repaired."""

    kind: str
    target: str
    at: float
    repair_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        """A JSON-able copy."""
        return asdict(self)


class FaultSchedule:
    """The rotation of faults over one rig; `next_fault` runs one and returns its event."""

    def __init__(self, rig: Rig) -> None:
        self.rig = rig
        kinds = CLUSTER_KINDS if rig.cluster is not None else KINDS
        self._kinds: Iterator[str] = itertools.cycle(kinds)
        # one turn per kind: a shared one would always kill the same worker and stop the other
        self._kill_turn = itertools.cycle(range(len(rig.workers)))
        self._stop_turn = itertools.cycle(range(len(rig.workers) - 1, -1, -1))
        self._clients = itertools.cycle(range(len(rig.clients)))
        self._masters = itertools.count()

    def next_fault(self) -> FaultEvent:
        """Inflict the next fault of the rotation and wait until it is repaired."""
        kind = next(self._kinds)
        run: Callable[[], str] = getattr(self, f"_{kind}")
        started_wall, started = time.time(), time.monotonic()
        target = run()
        return FaultEvent(kind, target, started_wall, round(time.monotonic() - started, 2))

    def _kill_worker(self) -> str:
        worker = self.rig.workers[next(self._kill_turn)]
        worker.kill()
        worker.start()
        self.rig.wait_live([worker])
        return worker.name

    def _stop_worker(self) -> str:
        worker = self.rig.workers[next(self._stop_turn)]
        worker.signal(signal.SIGSTOP)
        time.sleep(2 * self.rig.config.claim_idle_ms / 1000)
        worker.signal(signal.SIGCONT)
        return worker.name

    def _restart_redis(self) -> str:
        server = self.rig.queue_server
        server.kill()
        server.stop()
        server.start(timeout_s=60)
        return f"queue redis :{server.port}"

    def _restart_client(self) -> str:
        client = self.rig.clients[next(self._clients)]
        client.kill()
        client.start()
        return client.name

    def _kill_master(self) -> str:
        cluster = self.rig.cluster
        assert cluster is not None
        masters = cluster.master_ports()
        port = masters[next(self._masters) % len(masters)]
        cluster.kill_master(port, timeout_s=60)
        cluster.restart(port, timeout_s=60)
        return f"cluster master :{port}"

"""Which driver runs a query, kept in the query's checkpoint storage, so that any process on any
host can tell: a savepoint is not taken from a running query's checkpoint, and a restored
savepoint does not start beside the query it was taken from (both would write the same
transaction names and abort each other's).

``<checkpoint>/oncekit/lease``: ``{"host", "pid", "process", "renewed_at"}`` (seconds since the
epoch). Taken by :func:`~oncekit.core.spark.query.start_query` before the query starts, renewed
every :data:`RENEW_S` by its batch watchdog, released when the query ends. A lease not renewed
for :data:`EXPIRES_S` is void (its driver died or lost the storage); one of a process that is
gone from this host is void at once. Clocks of the hosts are taken to agree within seconds, as
Kafka and Spark themselves assume.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from dataclasses import asdict, dataclass

from oncekit.core.storage import delete_file, filesystem, read_bytes, write_atomically

LEASE = "oncekit/lease"
"""The lease file, relative to the checkpoint."""
RENEW_S = 10.0
EXPIRES_S = 45.0

_PROCESS = uuid.uuid4().hex  # this process, across pid reuse


@dataclass(frozen=True)
class Lease:
    host: str
    pid: int
    process: str
    renewed_at: float

    @classmethod
    def mine(cls) -> Lease:
        return cls(socket.gethostname(), os.getpid(), _PROCESS, time.time())

    @property
    def is_mine(self) -> bool:
        return self.process == _PROCESS

    def describe(self) -> str:
        return f"driver pid {self.pid} on {self.host}, lease renewed {max(0.0, time.time() - self.renewed_at):.0f} s ago"

    def void(self) -> bool:
        """Expired, or held by a process that is gone from this host."""
        if time.time() - self.renewed_at > EXPIRES_S:
            return True
        return self.host == socket.gethostname() and not os.path.exists(f"/proc/{self.pid}")


class QueryLease:
    """The lease of the query checkpointed at ``checkpoint``."""

    def __init__(self, checkpoint: str) -> None:
        self.fs, root = filesystem(checkpoint)
        self.path = f"{root}/{LEASE}"

    def holder(self) -> Lease | None:
        """The driver that holds the lease, None when nobody does (or the lease is void)."""
        try:
            found = Lease(**json.loads(read_bytes(self.fs, self.path)))
        except (FileNotFoundError, ValueError, TypeError):
            return None
        return None if found.void() else found

    def renew(self) -> None:
        """Driver: take or renew the lease for this process."""
        write_atomically(self.fs, self.path, json.dumps(asdict(Lease.mine())).encode())

    def release(self) -> None:
        """Driver, when its query ended: give the lease up, if this process holds it."""
        held = self.holder()
        if held is not None and held.is_mine:
            delete_file(self.fs, self.path)

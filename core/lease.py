"""Which driver runs a query, kept in the query's checkpoint storage, so that any process on any
host can tell: a savepoint is not taken from a running query's checkpoint, and a restored
savepoint does not start beside the query it was taken from (both would write the same
transaction names and abort each other's).

``<checkpoint>/oncekit/lease``: ``{"host", "pid", "process", "renewed_at", "run"}`` (seconds
since the epoch; ``run`` the query run's token, :class:`~oncekit.core.spark.writer.QueryRun`).
Taken by :func:`~oncekit.core.spark.query.start_query` before the query starts, renewed every
:data:`RENEW_S` by its batch watchdog, released when the query ends. A lease not renewed for
:data:`EXPIRES_S` (``ONCEKIT_LEASE_EXPIRY_S``) is void (its driver died or lost the storage); one of a process that is gone
from this host is void at once. A standby driver waits for a void lease (:func:`wait_free`).
A driver that finds its lease taken by another run (it was paused past the expiry, and a
standby took over) stops its query, and its stream writer refuses to journal a batch
(:func:`require_held`). Clocks of the hosts are taken to agree within seconds, as Kafka and
Spark themselves assume. The lease is advisory: two standbys that find it void at the same
moment both take it, so run one standby per pipeline.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from oncekit.core.errors import CommitError, ConfigError
from oncekit.core.storage import delete_file, filesystem, read_bytes, write_atomically

LEASE = "oncekit/lease"
"""The lease file, relative to the checkpoint."""
EXPIRY_ENV = "ONCEKIT_LEASE_EXPIRY_S"


def _expiry_s() -> float:
    setting = os.environ.get(EXPIRY_ENV, "45")
    try:
        seconds = float(setting)
    except ValueError:
        seconds = 0.0
    if not seconds >= 4:
        raise ConfigError(f"{EXPIRY_ENV}={setting!r}: give the lease's expiry in seconds, at least 4")
    return seconds


EXPIRES_S = _expiry_s()
"""A lease not renewed for this long is void (``ONCEKIT_LEASE_EXPIRY_S``, default 45): how long a
standby on another host waits after the active driver stopped renewing. Every driver and standby
of a query must have the same."""
RENEW_S = min(10.0, EXPIRES_S / 4)

_PROCESS = uuid.uuid4().hex  # this process, across pid reuse


@dataclass(frozen=True)
class Lease:
    host: str
    pid: int
    process: str
    renewed_at: float
    run: str = ""

    @classmethod
    def mine(cls, run: str) -> Lease:
        return cls(socket.gethostname(), os.getpid(), _PROCESS, time.time(), run)

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

    def renew(self, run: str) -> None:
        """Driver: take or renew the lease for this process's query run ``run``."""
        write_atomically(self.fs, self.path, json.dumps(asdict(Lease.mine(run))).encode())

    def release(self) -> None:
        """Driver, when its query ended: give the lease up, if this process holds it."""
        held = self.holder()
        if held is not None and held.is_mine:
            delete_file(self.fs, self.path)


def require_held(checkpoint: str, run: str, where: str) -> None:
    """Stream writer, before it journals a batch of query run ``run``: raise CommitError when
    another run holds the query's lease (this driver was paused past the expiry and another took
    over). A void lease is no reason to stop: no other driver holds it (a Spark Connect client
    that went away leaves its query's lease to lapse)."""
    holder = QueryLease(checkpoint).holder()
    if holder is not None and holder.run and holder.run != run:
        raise CommitError(f"{where}: the query's lease is held by another driver ({holder.describe()}); this one lost "
                          "it and journals nothing, so the batch is left to that driver")


def wait_free(checkpoints: Sequence[str], poll_s: float = 0.05, announce: Callable[[str], None] = lambda text: None,
              every: tuple[float, Callable[[], Any]] | None = None) -> None:
    """A standby driver, warmed up: return once no live driver holds any of ``checkpoints``'
    leases (at once when the holder's process is gone from this host, else when its lease
    lapses). ``announce`` hears who holds them while it waits; ``every`` = (seconds, call):
    ``call`` runs that often while it waits (:func:`oncekit.core.spark.standby.stand_by`'s warm-up)."""
    told: set[tuple[str, str]] = set()
    last = time.monotonic()
    while True:
        held = [(checkpoint, holder) for checkpoint in checkpoints
                if (holder := QueryLease(checkpoint).holder()) is not None and not holder.is_mine]
        if not held:
            return
        for checkpoint, holder in held:
            if (checkpoint, holder.process) not in told:
                told.add((checkpoint, holder.process))
                announce(f"standby: {checkpoint} is run by {holder.describe()}; waiting")
        if every is not None and time.monotonic() - last >= every[0]:
            every[1]()
            last = time.monotonic()
        time.sleep(poll_s)

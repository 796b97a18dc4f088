"""Which driver runs a query, kept in the query's checkpoint storage, so that any process on any
host can tell: a savepoint is not taken from a running query's checkpoint, a restored savepoint
does not start beside the query it was taken from, and a standby knows when to take over.

``<checkpoint>/oncekit/lease``: ``{"host", "pid", "process", "renewed_at", "run", "boot"}``
(seconds since the epoch; ``run`` the query run's token,
:class:`~oncekit.core.spark.writer.QueryRun`; ``boot`` the kernel's boot id and the pid
namespace, which tell whether ``pid`` can be looked up here). A driver process holds it through a
:class:`LeaseKeeper` from its query's first start until the query has stopped for good: renewed
every :data:`RENEW_S`, kept through the restart strategy's delays, so a query that fails and
restarts in place keeps it and a standby keeps waiting. A lease not renewed for
:data:`EXPIRES_S` (``ONCEKIT_LEASE_EXPIRY_S``) is void (its driver died, hung or lost the
storage); one of a process that is gone from this machine and pid namespace is void at once. A
standby waits for a void lease (:func:`wait_free`). A driver never overwrites another process's
lease: finding one, it stops its query (LeaseLostError), and its stream writer refuses to
journal a batch (:func:`require_held`).

The lease decides who runs; it does not make two drivers safe. It is read, then written, so two
standbys that find it void at the same moment both take it, and a driver paused past the expiry
acts once more when it wakes. What keeps the output exactly-once then is fencing at the sinks
(every run's epoch, refused by the target once a newer run took the sink). Clocks of the hosts
are taken to agree within seconds, as Kafka and Spark themselves assume.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from oncekit.core.errors import CommitError, ConfigError
from oncekit.core.storage import delete_file, filesystem, read_bytes, write_atomically

logger = logging.getLogger(__name__)

LEASE = "oncekit/lease"
"""The lease file, relative to the checkpoint."""
EXPIRY_ENV = "ONCEKIT_LEASE_EXPIRY_S"
DEFAULT_EXPIRY_S = 6.0
"""With renewals every 1.5 s and a warm standby's start of about 2.5 s, a standby on another host
commits its first batch within about 8 s of the active driver's death."""


def _expiry_s() -> float:
    setting = os.environ.get(EXPIRY_ENV, str(DEFAULT_EXPIRY_S))
    try:
        seconds = float(setting)
    except ValueError:
        seconds = 0.0
    if not seconds >= 4:
        raise ConfigError(f"{EXPIRY_ENV}={setting!r}: give the lease's expiry in seconds, at least 4")
    return seconds


EXPIRES_S = _expiry_s()
"""A lease not renewed for this long is void (``ONCEKIT_LEASE_EXPIRY_S``, default
:data:`DEFAULT_EXPIRY_S`): how long a standby on another host waits after the active driver
stopped renewing. Every driver and standby of a query must have the same. Shorter takes over
sooner and writes the lease to checkpoint storage more often; a driver that stalls longer than
this (a pause, an overloaded host) is taken over and stops with LeaseLostError: a wasted restart,
never a duplicate, since the sinks fence older runs."""
RENEW_S = min(10.0, EXPIRES_S / 4)
IDLE_S = max(120.0, 2 * EXPIRES_S)
"""How long a driver keeps the lease of a query that failed and was not started again: a restart
strategy restarts within this (else :func:`release_idle` gives the lease up when it gives up)."""

_PROCESS = uuid.uuid4().hex  # this process, across pid reuse


def _boot() -> str:
    """This machine's boot and pid namespace: a pid names the same process only where both match
    (containers that share a host name, cloned machines)."""
    try:
        boot_id = open("/proc/sys/kernel/random/boot_id").read().strip()
        return f"{boot_id}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return ""


_BOOT = _boot()


@dataclass(frozen=True)
class Lease:
    host: str
    pid: int
    process: str
    renewed_at: float
    run: str = ""
    boot: str = ""

    @classmethod
    def mine(cls, run: str) -> Lease:
        return cls(socket.gethostname(), os.getpid(), _PROCESS, time.time(), run, _BOOT)

    @property
    def is_mine(self) -> bool:
        return self.process == _PROCESS

    def describe(self) -> str:
        return f"driver pid {self.pid} on {self.host}, lease renewed {max(0.0, time.time() - self.renewed_at):.0f} s ago"

    def void(self) -> bool:
        """Expired, or held by a process that is gone from this machine and pid namespace."""
        if time.time() - self.renewed_at > EXPIRES_S:
            return True
        here = self.host == socket.gethostname() and bool(self.boot) and self.boot == _BOOT
        return here and not os.path.exists(f"/proc/{self.pid}")


class QueryLease:
    """The lease of the query checkpointed at ``checkpoint``."""

    def __init__(self, checkpoint: str) -> None:
        self.fs, root = filesystem(checkpoint)
        self.path = f"{root}/{LEASE}"

    def recorded(self) -> Lease | None:
        """The lease as written, void or not; None when there is none (or it cannot be read)."""
        try:
            return Lease(**json.loads(read_bytes(self.fs, self.path)))
        except (FileNotFoundError, ValueError, TypeError):
            return None

    def holder(self) -> Lease | None:
        """The driver that holds the lease, None when nobody does (or the lease is void)."""
        found = self.recorded()
        return None if found is None or found.void() else found

    def renew(self, run: str) -> None:
        """Driver: take or renew the lease for this process's query run ``run``."""
        write_atomically(self.fs, self.path, json.dumps(asdict(Lease.mine(run))).encode())

    def release(self) -> None:
        """Driver, when its query ended: give the lease up, if this process holds it."""
        held = self.holder()
        if held is not None and held.is_mine:
            delete_file(self.fs, self.path)


class LeaseKeeper:
    """This driver process's hold on one query's lease (one per checkpoint: :func:`keeper`).

    :func:`~oncekit.core.spark.query.start_query` calls :meth:`hold` at every start of the
    query; from the first, a daemon thread renews the lease every :data:`RENEW_S` until
    :meth:`release` (the query stopped, or ended for good), so the lease is kept while the
    restart strategy waits to start the query again. The thread never overwrites another
    process's lease: when it finds one, it stops and :meth:`taken_by` says who took it. A
    keeper whose query failed and was not started again within :data:`IDLE_S` releases the
    lease itself."""

    def __init__(self, checkpoint: str) -> None:
        self.lease = QueryLease(checkpoint)
        self.checkpoint = checkpoint
        self.run = ""
        self.query_id: str | None = None  # Spark's id of the query, once it started (start_query)
        self._taken: str | None = None
        self._idle_since: float | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def hold(self, run: str) -> None:
        """Driver, at a start of the query (run ``run``): take or keep the lease; ConfigError when
        another live driver holds it."""
        with self._lock:
            holder = self.lease.holder()
            if holder is not None and not holder.is_mine:
                raise ConfigError(
                    f"the query checkpointed at {self.checkpoint} is running ({holder.describe()}); two drivers on one "
                    f"checkpoint would take turns fencing each other. Stop it first; a driver that died leaves a lease "
                    f"that lapses within {EXPIRES_S:.0f} s")
            self.run, self._taken, self._idle_since = run, None, None
            self.lease.renew(run)
            if self._thread is None or self._stop.is_set() or not self._thread.is_alive():
                self._stop = threading.Event()
                self._thread = threading.Thread(target=self._renew, args=(self._stop,), daemon=True,
                                                name=f"oncekit-lease {self.checkpoint}")
                self._thread.start()

    def idle(self) -> None:
        """The query ended without being stopped for good (it failed): keep the lease for a
        restart, at most :data:`IDLE_S`."""
        with self._lock:
            if self._idle_since is None:
                self._idle_since = time.monotonic()

    @property
    def is_idle(self) -> bool:
        with self._lock:
            return self._idle_since is not None

    def taken_by(self) -> str | None:
        """Who took the lease from this process, once the renewal found it taken; else None."""
        return self._taken

    def release(self) -> None:
        """Driver, once its query has stopped and its last commits are done: stop renewing and
        give the lease up (if it is still this process's)."""
        with self._lock:
            self._stop.set()
            self._idle_since = None
            self.lease.release()

    def _renew(self, stop: threading.Event) -> None:
        while not stop.wait(RENEW_S):
            try:
                with self._lock:
                    if stop.is_set():
                        return
                    if self._idle_since is not None and time.monotonic() - self._idle_since > IDLE_S:
                        logger.warning("lease of %s: the query has not run for %.0f s; releasing it", self.checkpoint,
                                       IDLE_S)
                        stop.set()
                        self.lease.release()
                        return
                    found = self.lease.recorded()
                    if found is not None and not found.is_mine:
                        self._taken = found.describe()
                        logger.error("lease of %s: taken by another driver (%s); no longer renewed", self.checkpoint,
                                     self._taken)
                        return
                    self.lease.renew(self.run)
            except OSError as exc:  # storage unreachable: the next renewal tries again
                logger.warning("lease of %s: could not renew: %s", self.checkpoint, exc)


_keepers: dict[str, LeaseKeeper] = {}
_keepers_lock = threading.Lock()


def keeper(checkpoint: str) -> LeaseKeeper:
    """This process's :class:`LeaseKeeper` of ``checkpoint``'s lease."""
    with _keepers_lock:
        found = _keepers.get(checkpoint)
        if found is None:
            found = _keepers[checkpoint] = LeaseKeeper(checkpoint)
        return found


def release_idle(where: Callable[[LeaseKeeper], bool] = lambda kept: True) -> None:
    """Release the leases this process keeps for queries that failed, of the keepers ``where``
    accepts (all by default), so a standby takes over now. Called by
    :func:`~oncekit.core.restart.supervise` when it gives up (those queries will not start again
    here), and by :func:`~oncekit.core.spark.query.start_query` for the same query started from
    another checkpoint (a savepoint restored after the original failed)."""
    with _keepers_lock:
        idle = [found for found in _keepers.values() if found.is_idle and where(found)]
    for found in idle:
        try:
            found.release()
        except OSError as exc:
            logger.warning("lease of %s: could not release it: %s", found.checkpoint, exc)


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

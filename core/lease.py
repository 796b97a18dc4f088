"""Which driver runs a query, kept in the query's checkpoint storage, so that any process on any
host can tell: a savepoint is not taken from a running query's checkpoint, a restored savepoint
does not start beside the query it was taken from, and a standby knows when to take over.

``<checkpoint>/oncekit/lease``: ``{"host", "pid", "process", "renewed_at", "run", "boot",
"epoch"}`` (seconds since the epoch; ``run`` the query run's token,
:class:`~oncekit.core.run.QueryRun`; ``boot`` the kernel's boot id and the pid namespace, which
tell whether ``pid`` can be looked up here; ``epoch`` the run's fencing token once its first
writer took it, 0 before). A driver process holds it through a :class:`LeaseKeeper` from its
query's first start until the query has stopped for good: renewed every :data:`RENEW_S`, kept
through the restart strategy's delays, so a query that fails and restarts in place keeps it and a
standby keeps waiting. A lease not renewed for :data:`EXPIRES_S` (``ONCEKIT_LEASE_EXPIRY_S``) is
void (its driver died, hung or lost the storage); one of a process that is gone from this machine
and pid namespace is void at once. A standby waits for a void lease (:func:`wait_free`).

Who runs follows the epoch, so the lease's winner and the epoch's winner cannot differ for
long. The file is read, then written (storage offers no compare-and-set), so two standbys that
find it void at the same moment both take it, and a driver paused between its read and its write
may put its own record back once. Then the epochs decide: both standbys' first writers take an
epoch at the sinks' targets (one linearizable step each, so they differ); each records its epoch
in the lease (:meth:`QueryLease.stamp`) unless the lease holds a higher one, a keeper puts its
run's record back over a lower epoch's and stands aside for a higher one, and a run whose lease a
higher epoch holds stops (LeaseLostError) and, as a standby, waits again. What keeps the output
exactly-once meanwhile is not the lease but fencing at the targets. Clocks of the hosts are taken
to agree within seconds, as Kafka and Spark themselves assume.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from oncekit.core import clock
from oncekit.core.errors import CommitError, ConfigError, FencedError, LeaseHeldError
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


def _alive(pid: int) -> bool:
    """Whether process ``pid`` of this pid namespace exists. Asked of the kernel, not of /proc: on a
    /proc mounted with ``hidepid``, another user's process has no entry there and runs all the same."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, and belongs to another user
    return True


@dataclass(frozen=True)
class Driver:
    """Which driver process a lease names: where it runs, and its identity across pid reuse."""

    host: str
    pid: int
    process: str
    boot: str

    @classmethod
    def this(cls) -> Driver:
        return cls(socket.gethostname(), os.getpid(), _PROCESS, _BOOT)


@dataclass(frozen=True)
class Lease:
    host: str
    pid: int
    process: str
    renewed_at: float
    run: str = ""
    boot: str = ""
    epoch: int = 0
    stopped_with: str = ""
    """Set when the driver stopped the query with a savepoint (what it stopped with): nobody holds
    the lease, and a standby waits for a driver to start the query again rather than take it
    over (a job stopped for an upgrade stays stopped)."""

    @classmethod
    def of(cls, driver: Driver, run: str, epoch: int = 0) -> Lease:
        return cls(driver.host, driver.pid, driver.process, clock.now(), run, driver.boot, epoch)

    @classmethod
    def mine(cls, run: str, epoch: int = 0) -> Lease:
        return cls.of(Driver.this(), run, epoch)

    @property
    def is_mine(self) -> bool:
        return self.process == _PROCESS

    def of_driver(self, driver: Driver) -> bool:
        return self.process == driver.process

    def describe(self) -> str:
        return f"driver pid {self.pid} on {self.host}, lease renewed {max(0.0, clock.now() - self.renewed_at):.0f} s ago"

    def void(self) -> bool:
        """Expired, or held by a process that is gone from this machine and pid namespace."""
        if clock.now() - self.renewed_at > EXPIRES_S:
            return True
        return self.here() and not _alive(self.pid)

    def here(self) -> bool:
        """Whether the holder runs on this machine, in this boot (its pid can be looked at)."""
        return bool(self.boot) and self.boot == _BOOT and self.host == socket.gethostname()


@functools.lru_cache(maxsize=16)
def _parsed(data: bytes) -> Lease:
    """The lease written as ``data``, parsed once per content: keepers and standbys read the
    same record again and again between renewals (a :class:`Lease` is immutable, so one is
    shared). ValueError or TypeError when ``data`` is not a lease."""
    return Lease(**json.loads(data))


class QueryLease:
    """The lease of the query checkpointed at ``checkpoint``."""

    def __init__(self, checkpoint: str) -> None:
        self.fs, root = filesystem(checkpoint)
        self.path = f"{root}/{LEASE}"

    def recorded(self) -> Lease | None:
        """The lease as written, void or not; None when there is none (or it cannot be read)."""
        try:
            return _parsed(read_bytes(self.fs, self.path))
        except (FileNotFoundError, ValueError, TypeError):
            return None

    def holder(self) -> Lease | None:
        """The driver that holds the lease, None when nobody does (the lease is void, or its
        driver stopped the query with a savepoint)."""
        found = self.recorded()
        return None if found is None or found.void() or found.stopped_with else found

    def renew(self, run: str, epoch: int = 0, driver: Driver | None = None) -> None:
        """Driver: take or renew the lease for the query run ``run`` (of ``epoch``) of ``driver``
        (this process by default)."""
        self.write(Lease.of(driver or Driver.this(), run, epoch))

    def write(self, lease: Lease) -> None:
        write_atomically(self.fs, self.path, json.dumps(vars(lease)).encode())

    def stamp(self, driver: Driver, run: str, epoch: int) -> None:
        """The first stream writer of run ``run`` (of the driver process ``driver``), once the run
        took ``epoch`` at its sinks: record the epoch in the lease, so that every keeper and
        standby orders the runs by it. FencedError when the lease holds a higher epoch (a newer
        run took over while this one started)."""
        found = self.recorded()
        if found is not None and found.epoch > epoch:
            raise FencedError(f"the query checkpointed at {self.path.rsplit('/', 2)[0]} was taken over by a newer run "
                              f"(epoch {found.epoch}, {found.describe()}) while run {run} (epoch {epoch}) started")
        self.write(Lease.of(driver, run, epoch))

    def release(self, driver: Driver | None = None, stopped_with: str = "") -> None:
        """Driver, when its query ended: give the lease up, if ``driver`` (this process by
        default) holds it. A query stopped with a savepoint (``stopped_with`` says which) leaves
        a record of that instead, in the same write, so that no standby takes it over."""
        held = self.holder()
        if held is None or not held.of_driver(driver or Driver.this()):
            return
        if stopped_with:
            self.write(replace(held, renewed_at=clock.now(), stopped_with=stopped_with))
        else:
            delete_file(self.fs, self.path)


class LeaseKeeper:
    """This driver process's hold on one query's lease (one per checkpoint: :func:`keeper`).

    :func:`~oncekit.core.spark.query.start_query` calls :meth:`hold` at every start of the
    query; from the first, a daemon thread renews the lease every :data:`RENEW_S` until
    :meth:`release` (the query stopped, or ended for good), so the lease is kept while the
    restart strategy waits to start the query again. The thread stands aside from another run's
    record of a higher epoch (:meth:`taken_by` says whose) and puts its run's back over a lower
    epoch's (:meth:`renew_once`). A keeper whose query failed and was not started again within
    :data:`IDLE_S` releases the lease itself. ``driver`` is the process the lease names (this
    one; the simulation gives each of its drivers its own)."""

    def __init__(self, checkpoint: str, driver: Driver | None = None) -> None:
        self.lease = QueryLease(checkpoint)
        self.checkpoint = checkpoint
        self.driver = driver or Driver.this()
        self.run = ""
        self.epoch = 0  # the run's, once its first writer recorded it in the lease (QueryLease.stamp)
        self.query_id: str | None = None  # Spark's id of the query, once it started (start_query)
        self._taken: str | None = None
        self._idle_since: float | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def hold(self, run: str) -> None:
        """Driver, at a start of the query (run ``run``): take or keep the lease; LeaseHeldError
        when another live driver holds it."""
        with self._lock:
            holder = self.lease.holder()
            if holder is not None and not holder.of_driver(self.driver):
                raise LeaseHeldError(
                    f"the query checkpointed at {self.checkpoint} is running ({holder.describe()}); two drivers on one "
                    f"checkpoint would take turns fencing each other. Stop it first; a driver that died leaves a lease "
                    f"that lapses within {EXPIRES_S:.0f} s")
            self.run, self.epoch, self._taken, self._idle_since = run, 0, None, None
            self.lease.renew(run, driver=self.driver)
            if self._thread is None or self._stop.is_set() or not self._thread.is_alive():
                self._stop = threading.Event()
                self._thread = self.start_renewing(self._stop)

    def start_renewing(self, stop: threading.Event) -> threading.Thread:
        """The renewal loop's thread (:meth:`_renew` until ``stop``), started."""
        thread = threading.Thread(target=self._renew, args=(stop,), daemon=True, name=f"oncekit-lease {self.checkpoint}")
        thread.start()
        return thread

    def idle(self) -> None:
        """The query ended without being stopped for good (it failed): keep the lease for a
        restart, at most :data:`IDLE_S`."""
        with self._lock:
            if self._idle_since is None:
                self._idle_since = clock.monotonic()

    @property
    def is_idle(self) -> bool:
        with self._lock:
            return self._idle_since is not None

    def taken_by(self) -> str | None:
        """Who holds the lease instead of this process's run (a newer run, or a standby that
        took it over while this driver was paused), as the last renewal found it; else None."""
        return self._taken

    def release(self, stopped_with: str = "") -> None:
        """Driver, once its query has stopped and its last commits are done: stop renewing and
        give the lease up (if it is still this process's); ``stopped_with`` a savepoint, leave
        the record that keeps standbys waiting (:meth:`QueryLease.release`)."""
        with self._lock:
            self._stop.set()
            self._idle_since = None
            self.lease.release(self.driver, stopped_with)

    def _renew(self, stop: threading.Event) -> None:
        while not stop.wait(RENEW_S):
            try:
                with self._lock:
                    if stop.is_set():
                        return
                    if self._idle_since is not None and clock.monotonic() - self._idle_since > IDLE_S:
                        logger.warning("lease of %s: the query has not run for %.0f s; releasing it", self.checkpoint,
                                       IDLE_S)
                        stop.set()
                        self.lease.release(self.driver)
                        return
                    self.renew_once()
            except OSError as exc:  # storage unreachable: the next renewal tries again
                logger.warning("lease of %s: could not renew: %s", self.checkpoint, exc)

    def renew_once(self) -> None:
        """One renewal (the keeper's thread, every :data:`RENEW_S`): the lease is this run's, so
        renew it; or a lower epoch's (a driver paused between its read and its write put its
        record back), so put this run's back; or a higher epoch's, or a standby's that took it
        while this driver was paused, so stand aside (:meth:`taken_by`) and keep looking: this
        run's first writer may still record its epoch above it (:meth:`QueryLease.stamp`)."""
        found = self.lease.recorded()
        if found is not None and found.run == self.run and found.of_driver(self.driver):
            self.epoch = max(self.epoch, found.epoch)
            if self._taken is not None:
                logger.info("lease of %s: this driver's run %s holds it again", self.checkpoint, self.run)
            self._taken = None
            self.lease.renew(self.run, self.epoch, self.driver)
        elif found is None or found.stopped_with or (self.epoch and found.epoch < self.epoch):
            # no record, one a stopped run left (a superseded driver's late release), or a lower epoch's
            self.lease.renew(self.run, self.epoch, self.driver)
        else:
            if self._taken is None:
                logger.error("lease of %s: held by another driver (%s); this one stands aside", self.checkpoint,
                             found.describe())
            self._taken = found.describe()


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


def require_held(checkpoint: str, run: str, where: str, epoch: int = 0) -> None:
    """Stream writer, before it journals a batch of query run ``run`` (of ``epoch``): raise
    CommitError when another run holds the query's lease: a newer epoch's, or a standby's that
    took it while this driver was paused past the expiry. A lower epoch's record (a paused
    driver's, put back once) is no reason to stop, nor is a void lease: no other driver holds it
    (a Spark Connect client that went away leaves its query's lease to lapse). An early, named
    refusal; the sinks' targets refuse a superseded run's acts all the same."""
    holder = QueryLease(checkpoint).holder()
    if holder is not None and holder.run and holder.run != run and not (epoch and holder.epoch and holder.epoch < epoch):
        raise CommitError(f"{where}: the query's lease is held by another driver ({holder.describe()}); this one lost "
                          "it and journals nothing, so the batch is left to that driver")


def wait_free(checkpoints: Sequence[str], poll_s: float = 0.05, announce: Callable[[str], None] = lambda text: None,
              every: tuple[float, Callable[[], Any]] | None = None, driver: Driver | None = None) -> None:
    """A standby driver, warmed up: return once no live driver holds any of ``checkpoints``'
    leases (at once when the holder's process is gone from this host, else when its lease
    lapses) and none was stopped with a savepoint (then it waits until a driver starts the query
    again, and for that driver). ``announce`` hears who holds them while it waits; ``every`` =
    (seconds, call): ``call`` runs that often while it waits
    (:func:`oncekit.core.spark.standby.stand_by`'s warm-up)."""
    told: set[tuple[str, str]] = set()
    last = clock.monotonic()
    leases = {checkpoint: QueryLease(checkpoint) for checkpoint in checkpoints}
    while True:
        me = driver or Driver.this()
        held = [(checkpoint, found) for checkpoint, lease in leases.items()
                if (found := lease.recorded()) is not None and not found.of_driver(me)
                and (found.stopped_with or not found.void())]
        if not held:
            return
        for checkpoint, found in held:
            if (checkpoint, found.process + found.stopped_with) not in told:
                told.add((checkpoint, found.process + found.stopped_with))
                announce(f"standby: {checkpoint} was stopped with {found.stopped_with}; waiting until a driver starts "
                         "it again" if found.stopped_with else f"standby: {checkpoint} is run by {found.describe()}; waiting")
        if every is not None and clock.monotonic() - last >= every[0]:
            try:
                every[1]()
            except Exception as exc:  # noqa: BLE001 - a failed warm-up is tried again; the standby waits on
                logger.warning("standby: the periodic warm-up failed (tried again in %.0f s): %s", every[0], exc)
            last = clock.monotonic()
        due = None if every is None else last + every[0] - clock.monotonic()
        clock.sleep(_look_again_in([found for _, found in held], poll_s, due))


def _look_again_in(held: Sequence[Lease], poll_s: float, due: float | None) -> float:
    """How long a waiting standby sleeps before it reads the leases again: ``poll_s`` while a
    holder runs on this machine (its process may end at any moment) or a query waits for a
    driver to start it again; when every holder runs elsewhere, until the first of their leases
    could lapse (nothing but its holder's renewal or release changes it before then, and a
    release is found at that look), but no later than ``due`` (the next warm-up). A standby on
    another machine reads a remote checkpoint's lease about once per renewal, not every
    ``poll_s``."""
    if any(found.stopped_with or found.here() for found in held):
        return poll_s
    lapse = min(found.renewed_at for found in held) + EXPIRES_S - clock.now() + 0.01
    return max(poll_s, lapse if due is None else min(lapse, due))

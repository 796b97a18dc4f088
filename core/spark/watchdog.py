"""Flink's checkpoint timeout for Spark: the batch watchdog of one run of a query, in the user's
driver process (:class:`BatchWatchdog`). Started by :func:`~oncekit.core.spark.query.start_query`."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Any

from oncekit.core.deadline import bounded
from oncekit.core.errors import LeaseLostError, OncekitError, QueryStuckError, StallError
from oncekit.core.lease import EXPIRES_S, RENEW_S, QueryLease, keeper
from oncekit.core.spark_log import SparkLog
from oncekit.core.stacks import process_stacks
from oncekit.core.stalls import StallLog

if TYPE_CHECKING:
    from pyspark.sql.streaming.query import StreamingQuery

logger = logging.getLogger(__name__)

PLANNING_FLOOR_S = 30.0
"""The least time a running trigger may go without a progress report and without planning a
batch before the watchdog calls it a stall, whatever the batch timeout: Spark reports a trigger
that found no data only every ``spark.sql.streaming.noDataProgressEventInterval`` (10 s)."""
ACTIVE_POLL_S = 1.0
"""How often the batch watchdog asks whether its query is still active."""
STOP_S = 120.0
"""How long a stalled query may take to stop before the driver process is declared stuck."""
STRAGGLER_S = 3.0
"""How long a killed task may still run after its batch failed: Spark destroys its Python worker
after ``spark.python.task.killTimeout`` (2 s by default); 1 s more for a PREPARE already sent."""
SWEEP_S = 60.0
"""How long the driver's sweep of a failed run's stragglers may take (:func:`abort_stragglers`)."""

class BatchWatchdog:
    """Flink's checkpoint timeout, for one run of a query: a batch that Spark planned (its
    ``offsets/N``) and did not commit (``commits/N``) within ``timeout_s``, a trigger that runs
    that long without planning one (a source call hanging between batches), or an active query
    whose stream thread is gone, is a stall. The watchdog then logs where the driver's
    processes wait (:func:`~oncekit.core.stacks.process_stacks`), records the stall beside the
    checkpoint (:class:`~oncekit.core.stalls.StallLog`) and stops the query, so that
    :meth:`OncekitQuery.await_termination` raises StallError and the restart strategy takes over;
    a query that does not stop within :data:`STOP_S` raises QueryStuckError, which no restart
    inside the process can mend. When the run failed, whatever stopped it, the watchdog sweeps
    what its killed tasks left once they are gone (``sweep``: :func:`abort_stragglers`, on a
    thread of its own :data:`STRAGGLER_S` later). Started by :func:`start_query`; one daemon
    thread, which ends with the query."""

    def __init__(self, query: StreamingQuery, checkpoint: str, name: str, timeout_s: float, run: str = "",
                 sweep: Callable[[], None] | None = None) -> None:
        self.query, self.checkpoint, self.name, self.timeout_s, self.run = query, checkpoint, name, timeout_s, run
        self.sweep = sweep  # once the run failed: abort what killed tasks left (abort_stragglers)
        self.stall: OncekitError | None = None  # a StallError, or LeaseLostError when another driver took over
        self.stuck: QueryStuckError | None = None  # the query would not stop when this watchdog stopped it
        self._done = threading.Event()
        self._started = time.time()
        self._thread = threading.Thread(target=self._watch, name=f"oncekit-batch-watchdog {name}", daemon=True)

    def start(self) -> BatchWatchdog:
        self._thread.start()
        return self

    def close(self) -> None:
        self._done.set()

    def _watch(self) -> None:
        # The lease is the LeaseKeeper's: kept for a restart when the query failed, released
        # when it ended by itself (availableNow drained it, or Spark's own stop), else left to
        # OncekitQuery's stop or await_termination (which closed this watchdog).
        try:
            self._watch_batches(QueryLease(self.checkpoint))
        finally:
            failed = self._failed()
            if not self._done.is_set():
                self._ended(failed)
            if failed and self.sweep is not None and not isinstance(self.stall, LeaseLostError):
                try:  # not a daemon: a driver that exits on the failure still sweeps first
                    threading.Thread(target=self._sweep_stragglers, name=f"oncekit-straggler-sweep {self.name}").start()
                except RuntimeError as exc:  # the interpreter is shutting down: the next start's recovery sweeps
                    logger.info("query %s: no sweep of the failed run's stragglers: %s", self.name, exc)

    def _failed(self) -> bool:
        try:
            return self.stall is not None or self.query.exception() is not None
        except Exception:  # noqa: BLE001 - the session went away: keep the lease for a restart
            return True

    def _sweep_stragglers(self) -> None:
        """Once the run failed (whoever waits on it, and whether or not it is restarted): wait
        :data:`STRAGGLER_S` for the failed batch's killed tasks to be gone, then sweep."""
        assert self.sweep is not None
        time.sleep(STRAGGLER_S)
        try:
            bounded(f"query {self.name}: sweep of the failed run's stragglers", SWEEP_S, self.sweep)
        except Exception as exc:  # noqa: BLE001 - the next start's recovery aborts what is left
            logger.warning("query %s: the sweep of the failed run's stragglers failed (the next start's recovery "
                           "aborts what they left): %s", self.name, exc)

    def _ended(self, failed: bool) -> None:
        kept = keeper(self.checkpoint)
        if isinstance(self.stall, LeaseLostError):
            return
        if failed:
            kept.idle()
            return
        try:
            kept.release()
        except OSError as exc:
            logger.warning("query %s: could not release its lease: %s", self.name, exc)

    def _watch_batches(self, lease: QueryLease) -> None:
        log = SparkLog(self.checkpoint)
        looked = time.monotonic()
        every = min(max(self.timeout_s / 10, 0.5), RENEW_S)
        pending: tuple[int, float] | None = None  # (planned, not committed batch; when first seen so)
        busy: tuple[str, float] | None = None  # (what the running trigger does, for how long) with no batch planned
        threadless = 0
        while not self._closed_or_ended(every):
            try:
                if not self.query.isActive:
                    return
                if time.monotonic() - looked >= RENEW_S:
                    taken_by = self._taken_by(lease)
                    if taken_by is not None:
                        self._lost(taken_by)
                        return
                    looked = time.monotonic()
                planned, completed = log.latest_planned(), log.latest_completed()
            except Exception as exc:  # noqa: BLE001 - a session going away, storage unreachable: look again
                logger.debug("query %s: watchdog could not look: %s", self.name, exc)
                continue
            threadless = 0 if _stream_thread_alive(self.query) else threadless + 1
            if threadless >= 2:
                self._stalled(completed if completed is not None else -1, 0.0,
                              f"query {self.name}: active, but Spark's stream execution thread is gone")
                return
            if planned is None or planned == completed:
                pending = None
                busy = self._planning_for()
                if busy is not None and busy[1] > max(self.timeout_s, PLANNING_FLOOR_S):
                    self._stalled(completed if completed is not None else -1, busy[1],
                                  f"query {self.name}: its trigger has run {busy[1]:.0f} s without planning a batch "
                                  f"after batch {completed} ({busy[0]}; batch timeout {self.timeout_s:.0f} s)")
                    return
                continue
            busy = None
            if pending is None or pending[0] != planned:
                pending = (planned, time.monotonic())
                continue
            waited = time.monotonic() - pending[1]
            if waited > self.timeout_s:
                self._stalled(planned, waited, f"query {self.name} batch {planned}: planned and not committed "
                                               f"after {waited:.0f} s (batch timeout {self.timeout_s:.0f} s)")
                return

    def _planning_for(self) -> tuple[str, float] | None:
        """With no batch pending: what Spark's running trigger does (its status message) and how
        long it has run without a progress report (Spark reports a trigger that found no data
        every ``noDataProgressEventInterval``, 10 s); None while no trigger runs. A source call
        that hangs while Spark plans the next batch shows so, and no batch is ever overdue."""
        try:
            status = self.query.status
            progress = self.query.lastProgress
        except Exception:  # noqa: BLE001 - a session going away: the loop's own look decides
            return None
        if not status.get("isTriggerActive"):
            return None
        since = self._started
        if progress and progress.get("timestamp"):
            since = max(since, progress_started(progress))
        return str(status.get("message", "")), time.time() - since

    def _closed_or_ended(self, seconds: float) -> bool:
        """Wait ``seconds``; True as soon as the watchdog is closed or the query ended (looked at
        every :data:`ACTIVE_POLL_S`, so a query that ended by itself gives its lease up at once)."""
        deadline = time.monotonic() + seconds
        while not self._done.wait(max(0.0, min(ACTIVE_POLL_S, deadline - time.monotonic()))):
            try:
                if not self.query.isActive:
                    return True
            except Exception:  # noqa: BLE001 - the session going away: the loop's own look decides
                return False
            if time.monotonic() >= deadline:
                return False
        return True

    def _lost(self, holder: str) -> None:
        self.stall = self._lease_lost(holder)
        logger.error("%s", self.stall)
        self._stop(str(self.stall), "stop after losing its lease")

    def _taken_by(self, lease: QueryLease) -> str | None:
        """Who holds the lease, if another driver's run does (a newer epoch's, or a standby's that
        took it while this driver was paused); None while this run holds it, or when the record
        is a lower epoch's (a paused driver put its own back once: this run's keeper puts this
        run's back, :meth:`~oncekit.core.lease.LeaseKeeper.renew_once`)."""
        holder = lease.holder()
        mine = keeper(self.checkpoint).epoch
        if holder is not None and holder.run and holder.run != self.run and not (mine and holder.epoch
                                                                               and holder.epoch < mine):
            return holder.describe()
        return None

    def _lease_lost(self, holder: str) -> LeaseLostError:
        return LeaseLostError(f"query {self.name}: its lease is held by another driver ({holder}); this driver "
                              f"lost it (paused for more than {EXPIRES_S:.0f} s?) and stops its query")

    def lost_lease(self) -> LeaseLostError | None:
        """Called by :meth:`OncekitQuery.await_termination` when Spark failed the query: whether
        another driver's run holds the lease. A driver resumed after a pause past the lease's
        expiry can have Spark fail its query (its next log write meets the new driver's:
        CONCURRENT_STREAM_LOG_UPDATE) before this watchdog looks; that failure is then this
        LeaseLostError, which no restart mends, not Spark's error, which a restart strategy
        would retry against a checkpoint that runs elsewhere."""
        if isinstance(self.stall, LeaseLostError):
            return self.stall
        try:
            taken_by = self._taken_by(QueryLease(self.checkpoint))
        except Exception as exc:  # noqa: BLE001 - storage unreachable: Spark's error stands
            logger.debug("query %s: could not read its lease: %s", self.name, exc)
            return None
        if taken_by is None:
            return None
        self.stall = self._lease_lost(taken_by)
        logger.error("%s", self.stall)
        return self.stall

    def _stalled(self, batch: int, waited: float, message: str) -> None:
        logger.error("%s; stopping the query for its restart strategy. Where the driver's processes wait:\n%s",
                     message, process_stacks(os.getpid()))
        try:
            StallLog(self.checkpoint).record(batch, waited, message)
        except OSError as exc:
            logger.warning("query %s: could not record the stall: %s", self.name, exc)
        self.stall = StallError(message)
        self._stop(message, "stop after the stall")

    def _stop(self, why: str, step: str) -> None:
        """Stop the query for ``why`` within :data:`STOP_S`; a stop that hangs makes :attr:`stuck`,
        which :meth:`OncekitQuery.await_termination` raises: no restart inside this process can
        start the query again while Spark holds the old one (a deposed driver's writer journals
        nothing meanwhile, :func:`~oncekit.core.lease.require_held`)."""
        try:
            bounded(f"query {self.name}: {step}", STOP_S, self.query.stop)
        except StallError:
            self.stuck = QueryStuckError(f"{why}; the query did not stop within {STOP_S:.0f} s: restart the driver "
                                         "process")
            logger.error("%s", self.stuck)
        except Exception as exc:  # noqa: BLE001 - the query ended anyway
            logger.info("query %s: %s: %s", self.name, step, exc)


def _stream_thread_alive(query: StreamingQuery) -> bool:
    """Whether Spark's stream execution thread of an active query is alive (True where the JVM
    object cannot be reached, as in Spark Connect)."""
    try:
        return bool(query._jsq.streamingQuery().queryExecutionThread().isAlive())
    except Exception:  # noqa: BLE001 - not a classic session, or the query object is gone
        return True


def progress_started(progress: Mapping[str, Any]) -> float:
    """When the batch of a query progress (``query.lastProgress``, an item of
    ``recentProgress``) started, in seconds since the epoch (Spark writes an ISO time in UTC)."""
    return datetime.fromisoformat(str(progress["timestamp"]).replace("Z", "+00:00")).timestamp()

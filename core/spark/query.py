"""Starting queries with oncekit sinks, the checkpoint-complete listener, and the batch deadline.

``start_query`` registers the sink's Spark format, attaches one :class:`CheckpointListener` per
SparkSession, starts the query and a :class:`BatchWatchdog` for it. The listener and the
watchdog run in the user's driver process, where Spark delivers query progress; they reach the
journal and Spark's logs through storage, like everything else. From a Spark Connect client the
query runs in the server's driver and a listener would run in the client, which may go away
while the query runs on: there the run's committer on the server delivers the notifications
(:mod:`~oncekit.core.spark.committer`), and the client attaches no listener.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypedDict, cast

from pyspark import SparkContext
from pyspark.java_gateway import ensure_callback_server_started
from pyspark.sql import SparkSession

import oncekit
from oncekit.core.deadline import bounded
from oncekit.core.engine import CheckpointEngine
from oncekit.core.errors import ConfigError, LeaseLostError, OncekitError, QueryStuckError, StallError
from oncekit.core.journal import Journal
from oncekit.core.lease import EXPIRES_S, RENEW_S, QueryLease, keeper, release_idle
from oncekit.core.protocol import SinkConfig
from oncekit.core.fanout import FanOutConfig
from oncekit.core.spark.plan import reads_spark_kafka, refuse_changed_replay
from oncekit.core.spark.session import is_connect, register_data_source
from oncekit.core.spark.writer import QueryRun
from oncekit.core.spark_log import SparkLog
from oncekit.core.stacks import process_stacks
from oncekit.core.stalls import StallLog

if TYPE_CHECKING:
    from pyspark.sql import DataFrame
    from pyspark.sql.streaming.query import StreamingQuery


logger = logging.getLogger(__name__)

LAST_NOTIFICATION_WAIT_S = 60.0  # the listener's commit of the last batches; then the caller commits

BATCH_TIMEOUT_CONF = "spark.oncekit.batchTimeoutSeconds"
"""The session setting that gives every query started from it its batch deadline (seconds)."""
DEFAULT_BATCH_TIMEOUT_S = 300.0
DEFAULT_BATCH_TIMEOUT_TRIGGERS = 10
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


class CheckpointListener:
    """Delivers checkpoint-complete notifications: on every progress event, commits every
    journaled batch up to the reported one; when the query is idle or stops, commits all that
    completed.

    Spark calls it through py4j, as the Java interface ``PythonStreamingQueryListener`` that
    pyspark's own listeners implement, and it reads only an event's query id and batch id.
    pyspark's :class:`~pyspark.sql.streaming.StreamingQueryListener` converts every progress
    event whole, over a hundred py4j calls, most of them the exception that ends each iteration
    of a Java map: py-spy found 270 ms of the driver's Python for each batch there, on the two
    cores that ran the batches (kit source into the transactional Kafka sink, 2,000 records/s,
    default trigger)."""

    class Java:
        implements = ["org.apache.spark.sql.streaming.PythonStreamingQueryListener"]

    def __init__(self) -> None:
        self._watched: dict[str, list[tuple[SinkConfig, str, str]]] = {}
        self._terminated: dict[str, None] = {}  # the last runs whose termination notification has run
        self._lock = threading.Lock()

    def watch(self, run_id: str, config: SinkConfig, checkpoint: str, token: str = "") -> None:
        """Called by :func:`start_query` for Spark's run ``run_id`` of a query (a restarted
        query keeps its query id and gets a new run id): deliver that run's events, and only
        those, to the sink, with the epoch the kit's run ``token`` took."""
        with self._lock:
            self._watched.setdefault(run_id, []).append((config, checkpoint, token))

    def _notify(self, run_id: str, up_to: int | None) -> None:
        with self._lock:
            watched = list(self._watched.get(run_id, []))
        for config, checkpoint, token in watched:
            try:
                epoch = Journal(checkpoint, config.sink_id).runs().get(token, 0) if token else 0
                committed = CheckpointEngine.of(config, checkpoint, epoch).complete(up_to)
                if committed:
                    logger.info("sink %s: checkpoints %s complete and committed", config.sink_id, committed)
            except Exception as exc:  # the next batch's recovery retries; never kill the listener thread
                logger.error("sink %s: checkpoint-complete notification up to batch %s failed: %s",
                             config.sink_id, up_to, exc)

    # Spark's listener bus calls these with the Java events (py4j objects).
    def onQueryStarted(self, event: Any) -> None:
        pass

    def onQueryProgress(self, event: Any) -> None:
        progress = event.progress()
        self._notify(progress.runId().toString(), progress.batchId())

    def onQueryIdle(self, event: Any) -> None:
        # A notification that failed (the sink's service unreachable) is retried here, while
        # no new batch comes whose recovery would retry it.
        self._notify(event.runId().toString(), None)

    def onQueryTerminated(self, event: Any) -> None:
        run_id = event.runId().toString()
        self._notify(run_id, None)
        with self._lock:
            self._watched.pop(run_id, None)
            self._terminated[run_id] = None
            if len(self._terminated) > 1_000:  # a process that restarts queries for days
                del self._terminated[next(iter(self._terminated))]

    def terminated(self, run_id: str) -> bool:
        """Whether this listener has delivered the termination notification of Spark's run ``run_id``."""
        with self._lock:
            return run_id in self._terminated


# Keyed by the session object itself (weakly): an id() would be reused by a later session
# once the first is garbage-collected, and the new session would get a listener it never added.
_listeners: weakref.WeakKeyDictionary[SparkSession, CheckpointListener] = weakref.WeakKeyDictionary()
_listeners_lock = threading.Lock()


def listener(spark: SparkSession) -> CheckpointListener:
    """The session's checkpoint listener, attached on first use."""
    with _listeners_lock:
        found = _listeners.get(spark)
        if found is None:
            found = _listeners[spark] = CheckpointListener()
            gateway = SparkContext._gateway
            assert gateway is not None, "a classic session has a py4j gateway"
            ensure_callback_server_started(gateway)  # type: ignore[no-untyped-call]  # as streams.addListener does
            wrapper = gateway.jvm.org.apache.spark.sql.streaming.PythonStreamingQueryListenerWrapper(found)
            spark._jsparkSession.streams().addListener(wrapper)
        return found


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
        """Who holds the lease, if another driver's run does; None while this run holds it."""
        holder = lease.holder()
        if holder is not None and holder.run and holder.run != self.run:
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


def refuse_speculation(spark: SparkSession, sink: SinkConfig) -> None:
    """Called by :func:`start_query`: with ``spark.speculation`` a second attempt of a task runs
    beside the first, and a two-phase-commit attempt aborts what an earlier attempt of its
    partition left prepared, which may be the attempt Spark keeps; the driver then fails the
    batch rather than journal it (see CheckpointEngine.checkpoint), but a loser that aborts right
    after the journal is written would lose the winner's rows. So speculation is refused."""
    try:
        speculation = str(spark.conf.get("spark.speculation", "false")).strip().lower()
    except Exception:  # noqa: BLE001 - a session that cannot say (Spark Connect): nothing to refuse
        return
    if speculation == "true":
        raise ConfigError(f"sink {sink.sink_id}: spark.speculation=true runs two attempts of a task at once, which "
                          "exactly-once sinks cannot share a partition with; set spark.speculation=false")


class Trigger(TypedDict, total=False):
    """When a query's batches run: one of ``DataStreamWriter.trigger``'s keywords, typed.
    ``{"availableNow": True}`` drains what is there and stops; ``{"processingTime": "10
    seconds"}`` starts a batch every interval; none (Spark's default) starts the next batch as
    soon as the last one ended. ``once`` is Spark's deprecated ``availableNow`` with one batch.
    Spark's ``continuous`` is not offered: continuous processing has no batches to commit, and
    Spark's Python data sources do not support it."""

    availableNow: bool  # noqa: N815 - Spark's keyword
    processingTime: str  # noqa: N815 - Spark's keyword
    once: bool


def batch_timeout_s(spark: SparkSession, trigger: Trigger | None, given: float | None) -> float:
    """The batch deadline of a query: ``given``, else the session's :data:`BATCH_TIMEOUT_CONF`,
    else 5 minutes or 10 triggers, whichever is longer."""
    if given is None:
        setting = spark.conf.get(BATCH_TIMEOUT_CONF, None)
        if setting:
            try:
                given = float(setting)
            except ValueError as exc:
                raise ConfigError(f"{BATCH_TIMEOUT_CONF}={setting!r}: give a number of seconds") from exc
    if given is not None:
        if not given > 0:
            raise ConfigError(f"batch timeout {given}: give a number of seconds above 0 (inf for none)")
        return float(given)
    interval = _seconds((trigger or {}).get("processingTime"))
    return max(DEFAULT_BATCH_TIMEOUT_S, DEFAULT_BATCH_TIMEOUT_TRIGGERS * interval)


_UNITS = {"ms": 0.001, "millisecond": 0.001, "s": 1.0, "sec": 1.0, "second": 1.0, "m": 60.0, "min": 60.0,
          "minute": 60.0, "h": 3600.0, "hour": 3600.0}


def _seconds(interval: Any) -> float:
    """A processingTime interval ("500 milliseconds", "1 second", "2 minutes") in seconds; 0 for
    none or what this does not read."""
    match = re.fullmatch(r"(?:interval\s+)?([\d.]+)\s*([a-z]*)", str(interval or "").strip().lower())
    if match is None:
        return 0.0
    unit = match[2] if match[2] in _UNITS else match[2].removesuffix("s")
    return float(match[1]) * _UNITS.get(unit, 0.0)


class OncekitQuery:
    """A started query whose ``stop`` and ``await_termination`` (or Spark's name for it,
    ``awaitTermination``) end with a synchronous checkpoint-complete notification, so that once
    they return, every completed checkpoint's output is committed, and whose stalls end it with
    StallError (:class:`BatchWatchdog`). Everything else is the StreamingQuery's own."""

    def __init__(self, query: StreamingQuery, sink: SinkConfig, checkpoint: str,
                 watcher: CheckpointListener | None = None, watchdog: BatchWatchdog | None = None,
                 committer: bool = False, run: str = "") -> None:
        self.query, self.sink, self.checkpoint, self.watcher = query, sink, checkpoint, watcher
        self.watchdog, self.committer, self.run = watchdog, committer, run

    def __getattr__(self, name: str) -> Any:
        return getattr(self.query, name)

    def awaitTermination(self, timeout: float | None = None) -> bool:  # noqa: N802 - Spark's name
        """Spark's name for :meth:`await_termination`, with its guarantee: a PySpark user's
        ``query.awaitTermination()`` returns only after the last commits."""
        return self.await_termination(timeout)

    def exception(self) -> Any:
        """The query's error: a stall the watchdog ended it for, else Spark's own (None while
        it runs or when it ended well)."""
        if self.watchdog is not None and (self.watchdog.stuck or self.watchdog.stall) is not None:
            return self.watchdog.stuck or self.watchdog.stall
        return self.query.exception()

    def complete(self) -> list[int]:
        """Commit every journaled checkpoint that Spark logged as committed."""
        return CheckpointEngine.of(self.sink, self.checkpoint).complete()

    def _stopped(self) -> None:
        # The listener (or the server's committer) commits the last batches: their progress
        # events, then the termination. Wait until it has, rather than race it (two publishers
        # of one Kafka batch fence each other), then commit whatever it left. A driver that lost
        # its lease leaves them to the driver that took it over, for the same reason.
        if self.watchdog is not None and isinstance(self.watchdog.stall, LeaseLostError):
            return
        engine = CheckpointEngine.of(self.sink, self.checkpoint)
        deadline = time.monotonic() + LAST_NOTIFICATION_WAIT_S
        run_id = str(self.query.runId)
        while ((self.committer or (self.watcher is not None and not self.watcher.terminated(run_id)))
               and engine.uncommitted() and time.monotonic() < deadline):
            time.sleep(0.05)
        engine.complete()

    def stop(self) -> None:
        """Stop the query, commit its completed checkpoints, abort what this run left open of a
        batch Spark did not complete (the next start replays it), then give up its lease."""
        if self.watchdog is not None:
            self.watchdog.close()
        self.query.stop()
        self._stopped()
        if self.run and not (self.watchdog is not None and isinstance(self.watchdog.stall, LeaseLostError)):
            abort_unfinished(self.sink, self.checkpoint, self.run)
        self._release()

    def stop_at_batch_boundary(self, timeout_s: float = 120.0) -> None:
        """Stop between two batches: wait (up to ``timeout_s``) until no trigger runs, then
        :meth:`stop`; a query that ended with an error only has its completed checkpoints
        committed. A batch that starts in between is replayed by the next start, or by a
        savepoint's restore. Called for stop-with-savepoint by ``oncekit run`` and the reference
        pipeline."""
        deadline = time.monotonic() + timeout_s
        while self.query.isActive and self.query.status.get("isTriggerActive") and time.monotonic() < deadline:
            time.sleep(0.1)
        if self.query.isActive or self.query.exception() is None:
            self.stop()
        else:
            self.complete()

    def _release(self) -> None:
        """The query stopped for good and its last commits are done: a standby may take over."""
        if self.watchdog is not None and isinstance(self.watchdog.stall, LeaseLostError):
            return  # not this driver's any more
        try:
            keeper(self.checkpoint).release()
        except OSError as exc:
            logger.warning("query at %s: could not release its lease: %s", self.checkpoint, exc)

    def await_termination(self, timeout: float | None = None) -> bool:
        """Like StreamingQuery.awaitTermination; raises the query's error if it failed (as
        LeaseLostError if another driver holds the query's lease by then), and StallError if the
        watchdog ended it (QueryStuckError if it would not end)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            # Spark refuses a timeout under 1 ms ("Timeout has to be positive"), failing the query.
            wait = 1.0 if deadline is None else max(0.01, min(1.0, deadline - time.monotonic()))
            try:
                finished = self.query.awaitTermination(wait)  # type: ignore[arg-type]  # pyspark takes float seconds
            except Exception as exc:
                _refuse_missing_install(self.sink, exc)
                lost = self.watchdog.lost_lease() if self.watchdog is not None else None
                if lost is not None:
                    raise lost from exc
                keeper(self.checkpoint).idle()  # failed: the lease is kept for a restart, at most IDLE_S
                raise
            stall = self.watchdog.stall if self.watchdog is not None else None
            if self.watchdog is not None and self.watchdog.stuck is not None:
                raise self.watchdog.stuck from stall
            if finished is None or finished:
                if self.watchdog is not None:
                    self.watchdog.close()
                self._stopped()
                if stall is not None:
                    raise stall  # the restart strategy starts it again, under the lease kept meanwhile
                self._release()
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False


def abort_unfinished(sink: SinkConfig, checkpoint: str, run: str) -> list[str]:
    """Driver: abort what query run ``run`` (its epoch; nothing of any other run's) holds open
    that no commit will make visible (:meth:`~oncekit.core.engine.CheckpointEngine.abort_unfinished`).
    Called by :meth:`OncekitQuery.stop`, and :data:`STRAGGLER_S` after a run failed by its
    watchdog (:func:`abort_stragglers`)."""
    epoch = Journal(checkpoint, sink.sink_id).runs().get(run, 0)
    return CheckpointEngine.of(sink, checkpoint, epoch).abort_unfinished()


def abort_stragglers(sink: SinkConfig, checkpoint: str, run: str) -> None:
    """Driver, :data:`STRAGGLER_S` after run ``run`` failed (:class:`BatchWatchdog`): the stream
    writer's abort swept the failed batch at once, while Spark's killed tasks could still
    pre-commit; this sweeps what they left. Fenced by the run's epoch, so a restart that began
    meanwhile loses nothing: its own transactions are never touched, and a replayed task that
    waits on a straggler's locks goes on once it is aborted."""
    aborted = abort_unfinished(sink, checkpoint, run)
    if aborted:
        logger.warning("sink %s: aborted %s, left by killed tasks of run %s's failed batch", sink.sink_id,
                       ", ".join(aborted), run)


def _release_same_query_elsewhere(checkpoint: str) -> None:
    """Give up the lease this process keeps for a failed run of the same query (same Spark query
    id) from another checkpoint: starting it from ``checkpoint`` (a restored savepoint) means the
    failed one will not be restarted (its checkpoint may be gone), and its lease would refuse
    this start's sink claim."""
    query_id = SparkLog(checkpoint).query_id()
    if query_id is not None:
        release_idle(lambda kept: kept.checkpoint != checkpoint and kept.query_id == query_id)


def refuse_moving_partitions(frame: DataFrame, sink: SinkConfig) -> None:
    """Called by :func:`start_query`: Spark's own Kafka source plans a batch's ranges in the
    order of its map of offsets, which it reads back from the offset log when the batch is
    planned again after a restart, so a topic-partition can land in another task than the first
    time. A sink committing per task with a marker per partition (the ``transactional``
    protocol) would then find another partition's records under its marker and refuse the
    replay for good. Such a query is refused at its start, naming the way out."""
    targets = list(sink.targets.values()) if isinstance(sink, FanOutConfig) else [sink]
    per_task = [target.sink_id for target in targets if target.protocol == "transactional"]
    if per_task and reads_spark_kafka(frame):
        raise ConfigError(f"sink {', '.join(per_task)}: Spark's Kafka source may give a topic-partition to another task "
                          "when it plans a batch again after a restart, and a transactional sink commits per task, so "
                          "it could not recover; read with kafka_stream(..., connector='oncekit'), or write with the "
                          "write-ahead-log protocol")


def start_query(
    frame: DataFrame,
    sink: SinkConfig,
    checkpoint: str,
    *,
    trigger: Trigger | None = None,
    query_name: str | None = None,
    output_mode: str = "append",
    notify: bool = True,
    batch_timeout: float | None = None,
) -> OncekitQuery:
    """Start ``frame`` into ``sink`` with checkpoint-complete notifications and a batch deadline.

    ``trigger`` takes DataStreamWriter.trigger's keywords (:class:`Trigger`: ``{"availableNow": True}``).
    With ``notify=False`` no listener is attached (as with a plain ``format(...)`` query):
    completion then reaches the sink when the next batch starts. On a Spark Connect session the
    notifications come from a committer process on the server instead of a listener
    (:mod:`~oncekit.core.spark.committer`), whether or not the client stays attached. ``batch_timeout`` (seconds;
    default the session's ``spark.oncekit.batchTimeoutSeconds``, else 5 minutes or 10 triggers,
    whichever is longer; ``float("inf")`` for none) is how long a planned batch may take to
    commit before the query is stopped as stalled (:class:`BatchWatchdog`).
    """
    spark = frame.sparkSession
    refuse_speculation(spark, sink)
    refuse_moving_partitions(frame, sink)
    register_data_source(spark, sink.data_source())
    if "://" not in checkpoint and not checkpoint.startswith("file:"):
        checkpoint = os.path.abspath(checkpoint)
    remote = is_connect(spark)
    run = QueryRun.started(listener=notify and not remote, committer=notify and remote)
    _release_same_query_elsewhere(checkpoint)
    keeper(checkpoint).hold(run.token or "")
    refuse_changed_replay(frame, sink, checkpoint)
    writer = (frame.writeStream.format(sink.format_name).options(**sink.to_options(), **run.to_options())
              .option("checkpointLocation", checkpoint).outputMode(output_mode))
    if trigger:
        writer = writer.trigger(**cast(dict[str, Any], trigger))
    if query_name:
        writer = writer.queryName(query_name)
    timeout_s = batch_timeout_s(spark, trigger, batch_timeout)
    watcher = listener(spark) if run.listener else None
    try:
        query = writer.start()
    except Exception as exc:
        _refuse_missing_install(sink, exc)
        raise
    keeper(checkpoint).query_id = str(query.id)
    if watcher is not None:
        watcher.watch(str(query.runId), sink, checkpoint, run.token or "")
    watchdog = BatchWatchdog(query, checkpoint, query_name or sink.sink_id, timeout_s, run.token or "",
                             functools.partial(abort_stragglers, sink, checkpoint, run.token or "")).start()
    return OncekitQuery(query, sink, checkpoint, watcher, watchdog, run.committer, run.token or "")


def _refuse_missing_install(sink: SinkConfig, error: Exception) -> None:
    """Called with the error of a query's start or run: where the Spark driver's or executors'
    Python has no oncekit (a Spark Connect server set up without it), say so rather than show
    a worker's traceback."""
    if "No module named 'oncekit'" in str(error):
        raise ConfigError(f"sink {sink.sink_id}: the Python that runs the query's Spark workers has no oncekit; install "
                          f"oncekit=={oncekit.__version__} (the client's) in the Python environment of the Spark "
                          "driver and executors (a Spark Connect server's PYSPARK_PYTHON)") from error


def progress_started(progress: Mapping[str, Any]) -> float:
    """When the batch of a query progress (``query.lastProgress``, an item of
    ``recentProgress``) started, in seconds since the epoch (Spark writes an ISO time in UTC)."""
    return datetime.fromisoformat(str(progress["timestamp"]).replace("Z", "+00:00")).timestamp()

"""Starting queries with oncekit sinks: :func:`start_query` and the :class:`OncekitQuery` it returns.

``start_query`` registers the sink's Spark format, takes the query's lease, attaches one
checkpoint listener per SparkSession (:mod:`~oncekit.core.spark.listener`), starts the query and
a batch watchdog for it (:mod:`~oncekit.core.spark.watchdog`). The listener and the watchdog run
in the user's driver process, where Spark delivers query progress; they reach the journal and
Spark's logs through storage, like everything else. From a Spark Connect client the query runs in
the server's driver and a listener would run in the client, which may go away while the query
runs on: there the run's committer on the server delivers the notifications
(:mod:`~oncekit.core.spark.committer`), and the client attaches no listener.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pyspark.sql import SparkSession
from pyspark.sql.types import ArrayType, DataType, MapType, StructType, VariantType

import oncekit
from oncekit.core.compat import refuse_unsupported_spark
from oncekit.core.engine import CheckpointEngine
from oncekit.core.errors import ConfigError, LeaseLostError, as_oncekit_error
from oncekit.core.fanout import sinks_of
from oncekit.core.lease import keeper, release_idle
from oncekit.core.protocol import SinkConfig
from oncekit.core.run import QueryRun, settle
from oncekit.core.spark.listener import CheckpointListener, listener
from oncekit.core.spark.plan import reads_spark_kafka, refuse_changed_replay
from oncekit.core.spark.session import default_parallelism, is_connect, register_data_source
from oncekit.core.spark.watchdog import BatchWatchdog
from oncekit.core.spark_log import SparkLog

if TYPE_CHECKING:
    from pyspark.sql import DataFrame
    from pyspark.sql.streaming.query import StreamingQuery


logger = logging.getLogger(__name__)

LAST_NOTIFICATION_WAIT_S = 60.0  # the listener's commit of the last batches; then the caller commits

BATCH_TIMEOUT_CONF = "spark.oncekit.batchTimeoutSeconds"
"""The session setting that gives every query started from it its batch deadline (seconds)."""
DEFAULT_BATCH_TIMEOUT_S = 300.0
"""A batch's deadline where neither the query nor the session gives one: at least this many seconds."""
DEFAULT_BATCH_TIMEOUT_TRIGGERS = 10
"""... or this many trigger intervals, whichever is longer."""


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


@dataclass(frozen=True)
class Trigger:
    """When a query's batches run: Spark's triggers (``DataStreamWriter.trigger``'s keywords, in
    snake case), checked when made. ``Trigger(processing_time="10 seconds")`` starts a batch every
    interval; ``Trigger(available_now=True)`` drains what is there (in as many batches as the
    source's batch size needs) and stops; ``Trigger()``, like no trigger, starts the next batch as
    soon as the last one ended. Spark's deprecated ``once`` is ``available_now`` with one batch;
    ``continuous`` is not offered (continuous processing has no batches to commit, and Spark's
    Python data sources do not support it).

    :param processing_time: the interval, as Spark reads it: ``"500 milliseconds"``,
        ``"10 seconds"``, ``"1 minute"``.
    :param available_now: drain the input there is now, then stop."""

    processing_time: str | None = None
    available_now: bool = False

    def __post_init__(self) -> None:
        if self.processing_time is not None and self.available_now:
            raise ConfigError("Trigger: give processing_time or available_now, not both")
        if self.processing_time is not None and _seconds(self.processing_time) is None:
            raise ConfigError(f"Trigger: processing_time {self.processing_time!r} is not an interval Spark reads; "
                              "give a number and a unit: '500 milliseconds', '10 seconds', '1 minute'")

    @property
    def interval_s(self) -> float:
        """The processing-time interval in seconds (0 for none)."""
        return 0.0 if self.processing_time is None else _seconds(self.processing_time) or 0.0

    def keywords(self) -> dict[str, Any]:
        """What ``DataStreamWriter.trigger`` takes for this trigger (nothing: Spark's default)."""
        if self.available_now:
            return {"availableNow": True}
        return {} if self.processing_time is None else {"processingTime": self.processing_time}


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
    return max(DEFAULT_BATCH_TIMEOUT_S, DEFAULT_BATCH_TIMEOUT_TRIGGERS * (trigger.interval_s if trigger else 0.0))


_UNITS = {"ms": 0.001, "millisecond": 0.001, "s": 1.0, "sec": 1.0, "second": 1.0, "m": 60.0, "min": 60.0,
          "minute": 60.0, "h": 3600.0, "hour": 3600.0, "d": 86400.0, "day": 86400.0}


def _seconds(interval: str) -> float | None:
    """A processing-time interval ("500 milliseconds", "1 second", "2 minutes", "interval 1
    hour") in seconds; None for what this does not read."""
    match = re.fullmatch(r"(?:interval\s+)?(\d+(?:\.\d+)?)\s*([a-z]*)", interval.strip().lower())
    if match is None:
        return None
    unit = match[2] if match[2] in _UNITS else match[2].removesuffix("s")
    return float(match[1]) * _UNITS[unit] if unit in _UNITS else None


class OncekitQuery:
    """A started query whose ``stop`` and ``await_termination`` (or Spark's name for it,
    ``awaitTermination``) end with a synchronous checkpoint-complete notification, so that once
    they return, every completed checkpoint's output is committed, and whose stalls end it with
    StallError (:class:`BatchWatchdog`). Everything else is the StreamingQuery's own."""

    def __init__(self, query: StreamingQuery, sink: SinkConfig, checkpoint: str,
                 watcher: CheckpointListener | None = None, watchdog: BatchWatchdog | None = None,
                 committer: bool = False, run: str = "", query_run: QueryRun | None = None) -> None:
        self.query, self.sink, self.checkpoint, self.watcher = query, sink, checkpoint, watcher
        self.watchdog, self.committer, self.run = watchdog, committer, run
        self.query_run = query_run or QueryRun(run or None)

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
        """Commit every decided checkpoint that Spark logged as committed, acting for this run's
        epoch (a run that a newer one superseded is refused at the sinks' targets;
        :func:`~oncekit.core.run.settle`)."""
        return settle(self.sink, self.checkpoint, self.query_run)

    def _stopped(self) -> None:
        # The listener (or the server's committer) commits the last batches: their progress
        # events, then the termination. Wait until it has, rather than race it (two publishers
        # of one Kafka batch fence each other), then commit whatever it left. A driver that lost
        # its lease leaves them to the driver that took it over, for the same reason.
        if self.watchdog is not None and isinstance(self.watchdog.stall, LeaseLostError):
            return
        waiting = CheckpointEngine.of(self.sink, self.checkpoint)  # reads only: what is left to commit
        deadline = time.monotonic() + LAST_NOTIFICATION_WAIT_S
        run_id = str(self.query.runId)
        while ((self.committer or (self.watcher is not None and not self.watcher.terminated(run_id)))
               and waiting.uncommitted() and time.monotonic() < deadline):
            time.sleep(0.05)
        self.complete()

    def stop(self) -> None:
        """Stop the query, commit its completed checkpoints, abort what this run left open of a
        batch Spark did not complete (the next start replays it), then give up its lease."""
        self._stop()

    def _stop(self, stopped_with: str = "") -> None:
        if self.watchdog is not None:
            self.watchdog.close()
        self.query.stop()
        self._stopped()
        if self.run and not (self.watchdog is not None and isinstance(self.watchdog.stall, LeaseLostError)):
            abort_unfinished(self.sink, self.checkpoint, self.run)
        self._release(stopped_with)

    def stop_at_batch_boundary(self, timeout_s: float = 120.0, *, stopped_with: str = "") -> None:
        """Stop between two batches: wait (up to ``timeout_s`` seconds) until no trigger runs, then
        :meth:`stop`; a query that ended with an error only has its completed checkpoints
        committed. A batch that starts in between is replayed by the next start, or by a
        savepoint's restore. Called for stop-with-savepoint by ``oncekit run`` and the reference
        pipeline.

        :param timeout_s: how long to wait for the running batch to end before stopping anyway.
        :param stopped_with: the savepoint the query stops for: its lease then says so, and a
            standby waits for a driver to start the query again instead of taking it over."""
        deadline = time.monotonic() + timeout_s
        while self.query.isActive and self.query.status.get("isTriggerActive") and time.monotonic() < deadline:
            time.sleep(0.1)
        if self.query.isActive or self.query.exception() is None:
            self._stop(stopped_with)
        else:
            self.complete()

    def _release(self, stopped_with: str = "") -> None:
        """The query stopped for good and its last commits are done: a standby may take over,
        unless it stopped with a savepoint (``stopped_with``)."""
        if self.watchdog is not None and isinstance(self.watchdog.stall, LeaseLostError):
            return  # not this driver's any more
        try:
            keeper(self.checkpoint).release(stopped_with)
        except OSError as exc:
            logger.warning("query at %s: could not release its lease: %s", self.checkpoint, exc)

    def await_termination(self, timeout: float | None = None) -> bool:
        """Like StreamingQuery.awaitTermination: wait until the query ends, then commit its last
        completed checkpoints.

        :param timeout: seconds to wait at most; None waits until the query ends.
        :returns: True once the query ended and its output is committed; False when ``timeout``
            passed first.
        :raises OncekitError: the query's error as the kit's class (an error raised on an
            executor too, with Spark's exception as its cause); LeaseLostError if another driver
            holds the query's lease by then, StallError if the watchdog ended it,
            QueryStuckError if it would not end."""
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
                raised = as_oncekit_error(exc)  # a Python worker's error as the kit's own class
                if raised is exc:
                    raise
                raise raised from exc
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
    engine = CheckpointEngine.for_run(sink, checkpoint, run)
    return engine.abort_unfinished() if engine is not None else []


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


def writers_in_place(frame: DataFrame, sink: SinkConfig) -> DataFrame:
    """Called by :func:`start_query`: the frame a sink that commits per task writes, where the
    source alone would not give a replayed batch's tasks their first rows.

    Spark's own Kafka source plans a batch's ranges in the order of its map of offsets, which
    it reads back from the offset log when the batch is planned again after a restart, so a
    topic-partition can land in another task than the first time. The transactional Kafka sink
    commits per task, with a marker per writer partition: a replay that gave partition 0 other
    rows would be refused (its checksum differs) or, had partition 0 not committed yet, would
    write rows another partition already committed. So behind Spark's source the rows go to
    the writer tasks by a hash of their values: a replay reads the same records, and each
    writer partition gets the same rows as the first time, however the source's tasks were
    planned. The count of writer tasks is the session's default parallelism (on Spark Connect,
    ``spark.sql.shuffle.partitions``); it is part of the plan the checkpoint records, so a
    half-committed batch is not replayed with another count (:func:`refuse_changed_replay`)."""
    per_task = [target.sink_id for target in sinks_of(sink) if target.protocol == "transactional"]
    if not per_task or not reads_spark_kafka(frame):
        return frame
    hashed = [field.name for field in frame.schema.fields if _hashable(field.dataType)]
    if not hashed:
        raise ConfigError(f"sink {', '.join(per_task)}: behind Spark's Kafka source a transactional sink spreads the rows "
                          "over its tasks by a hash of their columns, and every column is a map or variant, which "
                          "Spark cannot hash; add a column of another type, or write with the write-ahead-log protocol")
    spark = frame.sparkSession
    tasks = default_parallelism(spark) or int(spark.conf.get("spark.sql.shuffle.partitions") or "200")
    logger.info("sink %s: Spark's Kafka source: the rows go to %s writer tasks by a hash of %s",
                ", ".join(per_task), tasks, ", ".join(hashed))
    return frame.repartition(tasks, *hashed)


def _hashable(kind: DataType) -> bool:
    """Whether Spark hashes a column of this type (maps and variants it refuses, at any depth)."""
    if isinstance(kind, (MapType, VariantType)):
        return False
    if isinstance(kind, ArrayType):
        return _hashable(kind.elementType)
    return not isinstance(kind, StructType) or all(_hashable(field.dataType) for field in kind.fields)


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
    """Start ``frame`` into ``sink`` with checkpoint-complete notifications and a batch deadline,
    holding the query's lease (one driver runs a checkpoint at a time):
    ``query = start_query(frame, postgres_sink(dsn, "balances"), "s3a://bucket/checkpoints/balances")``.

    :param frame: the streaming DataFrame, from :func:`~oncekit.kafka_stream` or any replayable source.
    :param sink: the sink, from :func:`~oncekit.postgres_sink`, :func:`~oncekit.kafka_sink` or
        :func:`~oncekit.fan_out`.
    :param checkpoint: the query's checkpoint location, as Spark's ``checkpointLocation``
        (a path or a URI Spark's file systems reach: ``hdfs://``, ``s3a://``...). The sink's
        journal lives beside Spark's offsets there.
    :param trigger: when batches run (:class:`Trigger`): ``Trigger(processing_time="10 seconds")``,
        ``Trigger(available_now=True)``; None runs the next batch as soon as the last one ended.
    :param query_name: Spark's query name (its UI and metrics).
    :param output_mode: Spark's output mode (``append``, ``update``, ``complete``).
    :param notify: attach the listener that commits each batch when Spark completes its
        checkpoint. With ``notify=False`` the commit reaches the sink when the next batch starts.
        On a Spark Connect session a committer process on the server delivers them instead,
        whether or not the client stays attached.
    :param batch_timeout: seconds a planned batch may take to commit before the query is stopped
        with :class:`~oncekit.StallError`; default the session's
        ``spark.oncekit.batchTimeoutSeconds``, else 5 minutes or 10 triggers, whichever is
        longer; ``float("inf")`` for none.
    :returns: the running query; wait on it with :meth:`OncekitQuery.await_termination`.
    """
    spark = frame.sparkSession
    refuse_unsupported_spark(spark.version)
    refuse_speculation(spark, sink)
    frame = writers_in_place(frame, sink)
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
    if trigger is not None and trigger.keywords():
        writer = writer.trigger(**trigger.keywords())
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
    return OncekitQuery(query, sink, checkpoint, watcher, watchdog, run.committer, run.token or "", run)


def _refuse_missing_install(sink: SinkConfig, error: Exception) -> None:
    """Called with the error of a query's start or run: where the Spark driver's or executors'
    Python has no oncekit (a Spark Connect server set up without it), say so rather than show
    a worker's traceback."""
    if "No module named 'oncekit'" in str(error):
        raise ConfigError(f"sink {sink.sink_id}: the Python that runs the query's Spark workers has no oncekit; install "
                          f"oncekit=={oncekit.__version__} (the client's) in the Python environment of the Spark "
                          "driver and executors (a Spark Connect server's PYSPARK_PYTHON)") from error



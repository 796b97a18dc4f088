"""A warm standby driver (issue 23 item 3): a second driver process that has its JVM, its Spark
session and the Python processes Spark keeps for Python data sources started, and waits until no
other driver holds the query's lease (:mod:`oncekit.core.lease`), so that it starts the query
seconds after the active driver died instead of the half minute a fresh driver takes.

In a job of your own, the caller hands in what its Python workers import and what to analyze
(the kit's Kafka source offers both, ``WARM_UP_MODULES`` and ``analyze_for_warm_up``)::

    frame = kafka_stream(spark, servers, "events")   # analyzed now, while the active driver runs
    stand_by(spark, [checkpoint], modules=modules, analyze=analyze)  # warm up, wait
    query = start_query(frame, sink, checkpoint)

What a warm-up starts (measured on two cores: a fresh session's first query spends 10-15 s on
them): Spark starts one long-lived Python process per worker module the first time a session
needs it (looking up, creating and planning a Python data source, creating its stream writer,
committing a micro-batch, running tasks), each importing pyspark and the kit (from
``pyspark.zip``, compiled afresh, unless :func:`~oncekit.core.spark.session.use_installed_pyspark`
applies).
A streaming query from a source of the kit's own into a no-op sink, one micro-batch on a
temporary checkpoint, starts all of them and imports the kit's connector modules in the task
workers. Spark ends task workers idle for a minute, so the warm-up is repeated every
:data:`REWARM_S` while waiting. A Spark Connect client has nothing to warm: the server keeps
its processes between queries.
"""

from __future__ import annotations

import importlib
import logging
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence

import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.datasource import (
    DataSource,
    DataSourceStreamArrowWriter,
    DataSourceStreamReader,
    InputPartition,
    WriterCommitMessage,
)
from pyspark.sql.streaming.datasource import ReadLimit, SupportsTriggerAvailableNow
from pyspark.sql.types import StructType

from oncekit.core.deadline import bounded
from oncekit.core.lease import wait_free
from oncekit.core.restart import RestartStrategy, superseded, supervise
from oncekit.core.spark.session import is_connect, register_data_source

logger = logging.getLogger(__name__)

WARM_UP_FORMAT = "oncekit-warm-up"
REWARM_S = 45.0
"""How often a waiting standby warms up again: Spark ends task workers idle for 60 s."""
WARM_UP_TIMEOUT_S = 120.0


def _import(modules: Sequence[str]) -> None:
    """In a task worker the query's tasks will reuse: the modules its reads and writes need
    (named by the caller, so that the engine imports no sink or source)."""
    for module in modules:
        importlib.import_module(module)


class _WarmUpReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """One micro-batch of one row in each of two partitions."""

    def __init__(self, modules: Sequence[str]) -> None:
        self.modules = tuple(modules)

    def initialOffset(self) -> dict[str, int]:
        return {"batch": 0}

    def latestOffset(self, start: dict[str, int], limit: ReadLimit) -> dict[str, int]:
        return {"batch": 1}

    def prepareForTriggerAvailableNow(self) -> None:
        pass

    def partitions(self, start: dict[str, int], end: dict[str, int]) -> Sequence[InputPartition]:
        return [InputPartition(0), InputPartition(1)] if end["batch"] > start["batch"] else []

    def read(self, partition: InputPartition) -> Iterator[tuple[int]]:
        _import(self.modules)
        yield (partition.value,)

    def commit(self, end: dict[str, int]) -> None:
        pass


class _WarmUpWriter(DataSourceStreamArrowWriter):
    def __init__(self, modules: Sequence[str]) -> None:
        self.modules = tuple(modules)

    def write(self, iterator: Iterator[pa.RecordBatch]) -> WriterCommitMessage:
        for _ in iterator:
            pass
        _import(self.modules)
        return WriterCommitMessage()

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        pass

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        pass


class WarmUpDataSource(DataSource):
    """``format("oncekit-warm-up")``: a stream source of one two-row batch and a stream sink
    that writes nothing (:func:`warm_up`)."""

    @classmethod
    def name(cls) -> str:
        return WARM_UP_FORMAT

    def schema(self) -> str:
        return "value int"

    def _modules(self) -> list[str]:
        return [m for m in self.options.get("modules", "").split(",") if m]

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return _WarmUpReader(self._modules())

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamArrowWriter:
        return _WarmUpWriter(self._modules())


def warm_up(spark: SparkSession, modules: Sequence[str] = (),
            analyze: Callable[[SparkSession], object] = lambda spark: None,
            plan: Callable[[DataFrame], DataFrame] = lambda frame: frame) -> float:
    """Standby driver, before it waits and every :data:`REWARM_S` while it does: ``analyze`` (the
    caller's: analyze a frame of the query's source, so Spark's planner processes start) and run
    one micro-batch of a throwaway query (:class:`WarmUpDataSource`) whose task workers import
    ``modules`` (the caller's sinks and sources), so that Spark's Python processes for the real
    query are started. ``plan`` (the caller's) turns the warm-up source's two rows (an int
    ``value``) into what the throwaway sink takes: the query's own operators there (its state,
    shuffle and Python functions) are planned, compiled and run once. Touches no service and no
    checkpoint of the user's; returns the seconds it took (0 on a Spark Connect session)."""
    if is_connect(spark):
        return 0.0
    started = time.monotonic()
    analyze(spark)
    register_data_source(spark, WarmUpDataSource)
    with tempfile.TemporaryDirectory(prefix="oncekit-warm-up-") as checkpoint:
        query = (plan(spark.readStream.format(WARM_UP_FORMAT).option("modules", ",".join(modules)).load())
                 .writeStream.format(WARM_UP_FORMAT).option("modules", ",".join(modules))
                 .option("checkpointLocation", checkpoint).trigger(availableNow=True).start())
        try:
            bounded("standby: the warm-up query", WARM_UP_TIMEOUT_S, query.awaitTermination)
        finally:
            query.stop()
    return time.monotonic() - started


def serve_as_standby(session: Callable[[], SparkSession], checkpoints: Sequence[str], attempt: Callable[[], None],
                     strategy: RestartStrategy, announce: Callable[[str], None] = logger.info,
                     warmed: Callable[[], None] = lambda: None, took_over: Callable[[], None] = lambda: None,
                     on_restart: Callable[[int, BaseException], None] | None = None, modules: Sequence[str] = (),
                     analyze: Callable[[SparkSession], object] = lambda spark: None) -> int:
    """A standby driver's life, for ``oncekit run --standby`` and the verify harness: warm up and
    wait for the query's lease (:func:`stand_by`), then run ``attempt`` (start the queries and wait
    for them) under ``strategy`` (:func:`~oncekit.core.restart.supervise`); whenever another
    driver turns out to run the queries (it won the race to take over, or took over from this
    one: :func:`~oncekit.core.restart.superseded`), warm up and wait again. Returns the restarts
    of the attempt that ended; any other failure is raised."""
    while True:
        stand_by(session(), checkpoints, announce=announce, warmed=warmed, modules=modules, analyze=analyze)
        took_over()
        try:
            return supervise(attempt, strategy, on_restart)
        except Exception as exc:
            if not superseded(exc):
                raise
            announce(f"standby: another driver runs the queries ({type(exc).__name__}); waiting again")


def stand_by(spark: SparkSession, checkpoints: Sequence[str], announce: Callable[[str], None] = logger.info,
             warmed: Callable[[], None] = lambda: None, modules: Sequence[str] = (),
             analyze: Callable[[SparkSession], object] = lambda spark: None,
             plan: Callable[[DataFrame], DataFrame] = lambda frame: frame) -> None:
    """A standby driver's wait: warm ``spark`` up (:func:`warm_up` with ``modules``, ``analyze``
    and ``plan``) and call ``warmed``, then return once no live driver holds any of
    ``checkpoints``' leases (:func:`~oncekit.core.lease.wait_free`), warming up again every
    :data:`REWARM_S`. Build the query's frames before, start the queries after.

    :param spark: the standby driver's session, warmed up while it waits.
    :param checkpoints: the checkpoints of the queries it stands by for.
    :param announce: called with each progress line (``standby: warmed up in 2.1 s``).
    :param warmed: called once the first warm-up is done.
    :param modules: modules to import while warming up (the job's own).
    :param analyze: builds the job's frames against ``spark`` (planning them warms Spark's analyzer).
    :param plan: what the job does to a frame, planned on a small one while warming up."""
    announce(f"standby: warmed up in {warm_up(spark, modules, analyze, plan):.1f} s")
    warmed()
    wait_free(checkpoints, announce=announce, every=(REWARM_S, lambda: warm_up(spark, modules, analyze, plan)))

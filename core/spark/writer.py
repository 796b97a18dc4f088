"""The thin Spark adapter: one stream writer class that runs any oncekit sink under the engine.

Where each method runs (checked on PySpark 4.3): Spark creates the writer in a Python worker on
the driver machine before every batch (to ship it to the tasks) and again for every driver-side
commit or abort; ``write`` runs in tasks on the executors. None of these processes has a
SparkSession, so the writer carries only the sink's configuration and the checkpoint location,
and every step reaches the journal through storage.

A query started by :func:`~oncekit.core.spark.query.start_query` carries a
:class:`~oncekit.core.run.QueryRun` in its options; what each writer of the run does on the
driver (the first one preflights, takes the run's epoch and recovers; later ones act for that
epoch) is :mod:`oncekit.core.run`'s, shared with the simulation of overlapping drivers. Later
writers leave checkpoint-complete notifications to the listener or to the run's server-side
committer (:mod:`~oncekit.core.spark.committer`, for a query started from a Spark Connect
client), or deliver them when there is neither. A query started with a plain
``format(...)...start()`` carries no run, and its first writer refuses it
(:func:`~oncekit.core.run.refuse_plain_start`).
"""

from __future__ import annotations

import inspect
import logging
import os
import struct
import sys
from collections.abc import Iterator
from types import FrameType
from typing import TYPE_CHECKING, Any, ClassVar

import pyspark
from pyspark import TaskContext
from pyspark.sql.datasource import DataSource, DataSourceStreamArrowWriter, DataSourceStreamWriter, WriterCommitMessage
from pyspark.sql.types import StructType

from oncekit.core.crash import crash_point
from oncekit.core.deadline import exit_if_stuck
from oncekit.core.engine import CheckpointEngine
from oncekit.core.errors import ConfigError, TaskInputCutError
from oncekit.core.fanout import FanOutConfig
from oncekit.core.protocol import Committable, SinkConfig, TaskInfo
from oncekit.core.run import QueryRun, commit_batch, open_run
from oncekit.core.spark import committer

if TYPE_CHECKING:
    import pyarrow as pa


logger = logging.getLogger(__name__)

# Spark's local property that tells a task which micro-batch it belongs to.
BATCH_ID_PROPERTY = "streaming.sql.batchId"

# What the JVM writes to a Python worker right after a task's whole input (pyspark's
# SpecialLengths.END_OF_STREAM, a big-endian int).
_END_OF_STREAM = struct.pack("!i", -4)
_WORKER_MAIN = os.path.join("pyspark", "worker.py")


class EngineCommitMessage(WriterCommitMessage):
    """What a task hands to the driver: its committables (none when there is nothing to commit)."""

    def __init__(self, committables: list[Committable]) -> None:
        self.committables = committables


def checkpoint_of(options: dict[str, str], sink: str) -> str:
    checkpoint = options.get("checkpointlocation")
    if not checkpoint:
        raise ConfigError(f"{sink}: the query needs a checkpointLocation; oncekit keeps its journal beside it")
    return checkpoint


class EngineStreamWriter(DataSourceStreamArrowWriter):
    """Spark's stream writer for every oncekit sink; the run's steps are :mod:`oncekit.core.run`'s
    and the protocol logic the engine's."""

    def __init__(self, config: SinkConfig, checkpoint: str, run: QueryRun) -> None:
        self.config, self.checkpoint, self.run = config, checkpoint, run
        self.token = run.token or ""

        def first_checks(engine: CheckpointEngine) -> None:
            refuse_unchecked_input(config.sink_id, engine.sink.commits_in_task, pyspark.__version__)

        engine, first = open_run(config, checkpoint, run, first_checks)
        self.epoch = engine.epoch
        if first and run.committer:
            committer.start(config, checkpoint, self.token)

    def _engine(self) -> CheckpointEngine:
        return CheckpointEngine.of(self.config, self.checkpoint, self.epoch)

    def write(self, iterator: Iterator[pa.RecordBatch]) -> WriterCommitMessage:
        """Task: write this partition of the batch through the sink (first leaving, in a worker that
        holds too many stuck calls, for a new one: :func:`~oncekit.core.deadline.exit_if_stuck`)."""
        context = TaskContext.get()
        if context is None:
            raise ConfigError(f"sink {self.config.sink_id}: write() ran outside a Spark task")
        batch = context.getLocalProperty(BATCH_ID_PROPERTY)
        if batch is None:
            raise ConfigError(f"sink {self.config.sink_id}: oncekit sinks run in streaming queries only")
        # taskAttemptId, unlike attemptNumber, differs between a killed task still finishing in the
        # background and the attempt that replaces it, so their transactions never share a name.
        task = TaskInfo(self.config.sink_id, int(batch), context.partitionId(), context.taskAttemptId(), self.epoch)
        exit_if_stuck(f"sink {task.sink_id} batch {task.batch_id} partition {task.partition_id}")
        engine = self._engine()
        return EngineCommitMessage(engine.write_task(task, whole_input(iterator, task, engine.sink.commits_in_task)))

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        """Driver: every task succeeded; journal and decide the batch before Spark logs it as
        committed (:func:`~oncekit.core.run.commit_batch`)."""
        commit_batch(self._engine(), self.run, batchId, _committables(messages))
        if self.run.committer:
            committer.wake(self.config, self.checkpoint, self.token, batchId)

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        """Driver: the batch failed; settle what this run's tasks pre-committed
        (:meth:`~oncekit.core.engine.CheckpointEngine.abort`). Spark fails a batch as soon as one
        task fails and kills the others without waiting: a killed task that already had its whole
        input may still pre-commit after this sweep, until Spark destroys its Python worker. The
        driver sweeps the failed run again once those are gone
        (:func:`~oncekit.core.spark.query.abort_stragglers`), so this returns at once and the
        failure (and a restart) is not held back."""
        crash_point("driver_abort", batchId)
        self._engine().abort(batchId, _committables(messages))


def whole_input(batches: Iterator[pa.RecordBatch], task: TaskInfo, required: bool = True) -> Iterator[pa.RecordBatch]:
    """The task's input, ending only where Spark ended it: raises TaskInputCutError instead.

    Why: when Spark kills a task (another task of the stage failed, the query stops), or what
    feeds it fails, the JVM shuts the worker's input down without finishing it; Arrow reads that
    end at a message boundary as a clean end of stream, and a sink that commits in the task
    (transactional Kafka) would commit part of its partition. The JVM writes END_OF_STREAM right
    after a whole input, so the worker's socket tells the two apart. Where the socket cannot be
    found, a sink that commits in the task (``required``) fails the task rather than commit
    unchecked; the others are safe without the check (a cut task's pre-commit is never
    journaled)."""
    yield from batches
    where = f"sink {task.sink_id} batch {task.batch_id} partition {task.partition_id}"
    if not _spark_sent_end_of_stream(where, required):
        # Logged as well as raised: when Spark killed the task, it drops the task's error unread.
        logger.warning("%s: task input cut short by Spark; committing nothing of this attempt", where)
        raise TaskInputCutError(f"{where}: Spark stopped sending the task's input before its end (task killed, or "
                                "its input failed); nothing of this task attempt is committed")


_warned_unchecked = False


def end_of_input_checkable() -> str | None:
    """Driver, at query start: None when pyspark's worker looks as :func:`whole_input` expects
    (``pyspark.worker.main`` reads the task from a local ``infile``), else what is different.
    A changed pyspark, a vendor runtime or ``spark.python.worker.module`` can each make it so."""
    try:
        from pyspark import worker
    except ImportError as exc:
        return f"pyspark.worker does not import ({exc})"
    main = getattr(worker, "main", None)
    code = getattr(inspect.unwrap(main), "__code__", None) if main is not None else None  # under pyspark's faulthandler wrapper
    if code is None or not code.co_filename.endswith(_WORKER_MAIN) or "infile" not in code.co_varnames:
        return "pyspark.worker.main has no local 'infile'"
    return None


def refuse_unchecked_input(sink_id: str, commits_in_task: bool, spark_version: str) -> None:
    """Driver, at query start: a sink that commits in the task needs the end-of-input check
    (:func:`whole_input`); refuse it where the check cannot work."""
    problem = end_of_input_checkable()
    if commits_in_task and problem is not None:
        raise ConfigError(
            f"sink {sink_id}: this pyspark ({spark_version}) is not one whose task input the kit can check to its end "
            f"({problem}), so a killed task could commit part of its partition; use the write-ahead-log protocol, "
            "which commits after the checkpoint and needs no such check")


def _spark_sent_end_of_stream(where: str, required: bool = True) -> bool:
    """Whether the next bytes from the JVM are its END_OF_STREAM mark (peeked, not consumed:
    pyspark's worker reads it after the task). pyspark gives the writer the Arrow batches but not
    the socket, so the socket is ``infile`` of ``pyspark.worker.main`` on the call stack. Not
    found: ConfigError when ``required``, else True (with a warning once)."""
    global _warned_unchecked
    frame: FrameType | None = sys._getframe()
    while frame is not None and not (frame.f_code.co_name == "main" and frame.f_code.co_filename.endswith(_WORKER_MAIN)):
        frame = frame.f_back
    infile: Any = frame.f_locals.get("infile") if frame is not None else None
    if not hasattr(infile, "peek"):
        if required:
            raise ConfigError(f"{where}: cannot see pyspark's worker socket, so the end of the task's input cannot be "
                              "checked; nothing of this task is committed. Use the write-ahead-log protocol")
        if not _warned_unchecked:
            _warned_unchecked = True
            logger.warning("%s: cannot see pyspark's worker socket; the end of task input is not checked", where)
        return True
    try:
        head = infile.peek(len(_END_OF_STREAM))[: len(_END_OF_STREAM)]
    except OSError:
        return False
    return bool(head) and _END_OF_STREAM.startswith(head)


def _committables(messages: list[Any]) -> list[Committable]:
    return [c for m in messages if isinstance(m, EngineCommitMessage) for c in m.committables]


class SinkDataSource(DataSource):
    """The Spark data source of one sink configuration type: ``format(config_type.format_name)``.
    A sink package declares one subclass with its ``config_type``."""

    config_type: ClassVar[type[SinkConfig]]

    @classmethod
    def name(cls) -> str:
        return cls.config_type.format_name

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        options = dict(self.options)
        config = self.config_type.from_options(options, tuple(schema.fieldNames()))
        return EngineStreamWriter(config, checkpoint_of(options, self.config_type.format_name),
                                  QueryRun.from_options(options))


class FanOutDataSource(SinkDataSource):
    """``format("oncekit-fanout")``: one query into many sinks (:mod:`oncekit.core.fanout`)."""

    config_type = FanOutConfig

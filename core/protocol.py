"""The contract between the checkpoint engine and every sink: what a sink implements so that
the engine can make it exactly-once, and what a sink's configuration provides.

The protocol bases, after Flink:

- :class:`TwoPhaseCommitSink`: tasks ``begin_transaction``, ``write``, ``pre_commit`` (returning a
  committable); once the checkpoint is complete the engine calls ``commit``; after a crash it
  calls ``recover_and_commit`` or ``recover_and_abort``. *A commit must be idempotent.*
- :class:`WriteAheadSink`: tasks stage their rows durably under the checkpoint; once the checkpoint
  is complete the engine calls ``send_values`` for the whole batch, which writes the values and
  records the checkpoint in the same transaction, so a repeated call sends nothing.
- :class:`IdempotentSink`: tasks write with deterministic keys (upsert); a replay rewrites the
  same rows, so there is nothing to commit later.
- :class:`TaskCommitSink`: tasks commit their own transaction together with a batch marker; a
  replay finds the marker and writes nothing (Kafka, whose transactions cannot outlive a producer).
- :class:`AtLeastOnceSink`: tasks write and commit at once; a replay writes again. For comparison
  and for targets that deduplicate on their own.

A sink for another system subclasses one of these and nothing else; it never sees Spark.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

from oncekit.core.crash import crash_point
from oncekit.core.errors import ConfigError
from oncekit.core.names import StagedFile, TransactionId

if TYPE_CHECKING:
    import pyarrow as pa

    from oncekit.core.staging import StagedFiles

logger = logging.getLogger(__name__)

_SINK_ID = re.compile(r"^[A-Za-z0-9_.-]{1,100}$")


class DeliveryGuarantee(enum.Enum):
    """What a sink promises about each input record's effect on the target after failures."""

    AT_MOST_ONCE = "at-most-once"
    AT_LEAST_ONCE = "at-least-once"
    EXACTLY_ONCE = "exactly-once"


class CommitOutcome(enum.Enum):
    """How a commit or abort request ended. Anything else raises a named error."""

    COMMITTED = "committed"
    ALREADY_COMMITTED = "already committed"
    ABORTED = "aborted"
    ALREADY_ABORTED = "already aborted"


@dataclass(frozen=True)
class TaskInfo:
    """Where a task writes: the sink, the checkpoint (= Spark batch id), the partition, the
    attempt (Spark's task attempt id: unique among all task attempts of the application), and
    the epoch of the query run the task belongs to (its fencing token; 0: a run that takes none)."""

    sink_id: str
    batch_id: int
    partition_id: int
    attempt: int
    epoch: int = 0

    @property
    def transaction_id(self) -> str:
        """Deterministic per (sink, batch, partition, attempt, epoch): a retried task gets a new
        id, and so does a replayed batch in a later run."""
        return str(TransactionId(self.sink_id, self.batch_id, self.partition_id, self.attempt, self.epoch))

    @property
    def staged_file(self) -> str:
        """The task's write-ahead-log file, relative to the sink's staging folder."""
        return str(StagedFile(self.batch_id, self.partition_id, self.attempt, self.epoch))


@dataclass(frozen=True)
class Committable:
    """What a task pre-committed, journaled by the driver, committed once the checkpoint completes.

    Exactly one of ``transaction_id`` (an open transaction: two-phase commit) and ``staged_file``
    (rows staged under the checkpoint, relative to the sink's staging folder: write-ahead log) is
    set; ``epoch`` is the query run's that made it. Frozen and JSON-serializable: the journal
    stores it as a dict.
    """

    sink_id: str
    batch_id: int
    partition_id: int
    attempt: int
    rows: int
    transaction_id: str | None = None
    staged_file: str | None = None
    epoch: int = 0

    @property
    def name(self) -> str:
        """What the committable holds open in the target or the checkpoint."""
        return self.transaction_id or self.staged_file or ""

    @property
    def key(self) -> tuple[str, str]:
        """Its identity among the committables of every sink of a query: (sink, name)."""
        return self.sink_id, self.name

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Committable:
        return cls(**data)


@dataclass(frozen=True)
class SinkOwner:
    """The query that writes through a sink id: its Spark query id (kept in its checkpoint) and
    its checkpoint location. Recorded in the target, so that a second checkpoint is refused."""

    query_id: str
    checkpoint: str


TxnT = TypeVar("TxnT")


class Sink(ABC):
    """The engine's view of every sink. Subclass one of the protocol bases below, not this."""

    protocol: ClassVar[str]
    guarantee: ClassVar[DeliveryGuarantee] = DeliveryGuarantee.EXACTLY_ONCE
    sink_id: str
    epoch: int = 0
    """The epoch of the query run this sink object acts for (:meth:`act_for`); 0: unfenced."""

    def act_for(self, epoch: int) -> None:
        """Engine: this object acts for the query run of ``epoch`` from now on."""
        self.epoch = epoch

    def take_epoch(self, floor: int) -> int:
        """Driver, at a query run's start, before its recovery: a new epoch above ``floor`` (the
        newest the journal knows) and above every epoch this sink gave before, recorded where the
        sink commits so that the target refuses older runs from now on. The default records
        nothing (a target whose own mechanism fences writers, such as Kafka's producer epochs)."""
        return floor + 1

    @property
    def commits_in_task(self) -> bool:
        """Whether a task makes its writes final itself (a task-commit sink, or a fan-out with
        one): then a task whose input Spark cut short must commit nothing."""
        return False

    def preflight(self, resumed: bool = False) -> None:
        """Driver, once per query start: check the target (tables, server settings) and raise a
        ConfigError that says what to fix. ``resumed``: this checkpoint has run the sink before,
        so what the sink keeps beside the target (markers) must be there. The default checks
        nothing."""

    @abstractmethod
    def write_partition(self, task: TaskInfo, batches: Iterator[pa.RecordBatch]) -> list[Committable]:
        """Task: write one partition of one batch; return what the driver must journal (nothing
        for protocols that commit in the task; several for a sink that fans out)."""

    def commit_batch(self, batch_id: int, committables: Sequence[Committable]) -> None:
        """Driver (or listener): make a completed checkpoint's output visible. Idempotent."""

    def abort_batch(self, batch_id: int, committables: Sequence[Committable]) -> None:
        """Driver: discard what an incomplete checkpoint pre-committed. Idempotent."""

    def leftovers(self, batch_ids: Iterable[int] | None = None) -> list[Committable]:
        """Driver: what the target still holds open for this sink (prepared transactions,
        staged files), for batches in ``batch_ids`` or all. Recovery aborts those no journal
        names. The default holds nothing open."""
        return []

    def refuse_claimed(self, owner: SinkOwner, in_use: Callable[[SinkOwner, SinkOwner], str | None]) -> None:
        """Driver, at query start after ``preflight``: refuse (ConfigError) a sink id whose
        recorded owner still holds it against ``owner`` (``in_use`` says why, or None when it
        does not: see :func:`oncekit.core.engine.owner_in_use`). Two checkpoints on one sink id
        share transaction ids, markers and marker rows: each would take the other's batches for
        its own and skip them, or abort the other's transactions. A checkpoint deleted to start
        over, or a savepoint restored (same query id) while its original is stopped, may take the
        id over (:meth:`claim`). Not atomic: two first starts at the same moment both pass."""
        current = self.recorded_owner()
        if current is not None and current != owner:
            reason = in_use(current, owner)
            if reason is not None:
                raise ConfigError(f"sink {self.sink_id}: {reason}; this query's checkpoint is {owner.checkpoint}")

    def claim(self, owner: SinkOwner) -> None:
        """Driver, at a query run's start after its epoch and recovery
        (:meth:`oncekit.core.engine.CheckpointEngine.start_run`), once :meth:`refuse_claimed`
        let ``owner`` have the sink id: record ``owner``. Another query taking the id over starts
        its batch numbers again, so the previous query's batch records are dropped first
        (:meth:`reset`): they would answer for the new query's batches of the same numbers,
        which would be skipped as committed. After the epoch and recovery, so that nothing the
        previous query's drivers still commit can land after the reset: its tasks are fenced by
        the epoch and its prepared transactions and staged batches were aborted. A crash between
        the reset and the record resets again at the next start."""
        current = self.recorded_owner()
        if current is not None and current.query_id != owner.query_id:
            logger.info("sink %s: query %s takes the sink id over from query %s; dropping its batch records",
                        self.sink_id, owner.query_id, current.query_id)
            self.reset()
        if current != owner:
            self.record_owner(owner)

    def recorded_owner(self) -> SinkOwner | None:
        """Driver: the owner recorded in the target for this sink id; None when none is (the
        default: a target that keeps no record, where :meth:`claim` checks nothing)."""
        return None

    def record_owner(self, owner: SinkOwner) -> None:
        """Driver: record ``owner`` for this sink id in the target, replacing any other."""

    def reset(self) -> None:
        """Driver, from :meth:`claim`, when another query takes the sink id over: drop every
        record of the previous query's batches (marker rows, recorded checkpoints, batch
        markers); raise when they cannot be dropped. The default keeps none."""

    def forget(self, before_batch: int) -> None:
        """Driver, in recovery, after the journal dropped batches Spark no longer keeps: drop the
        sink's own records of batches before ``before_batch`` (marker rows, recorded checkpoints).
        Those batches are committed and marked done, and Spark never runs them again, so nothing
        will ask about them; without this such records grow by one per batch forever. The
        default keeps nothing."""

    def close(self) -> None:
        """Release connections; called when the engine is done with the sink."""


class TwoPhaseCommitSink(Sink, Generic[TxnT]):
    """Flink's TwoPhaseCommitSinkFunction, snake_case: transactions that survive the task."""

    protocol = "two-phase-commit"

    @abstractmethod
    def begin_transaction(self, task: TaskInfo) -> TxnT:
        """Task: open a transaction named ``task.transaction_id``; first abort what earlier
        attempts of this run, or older runs, left open for the same (sink, batch, partition),
        never what a newer run left."""

    @abstractmethod
    def write(self, transaction: TxnT, batch: pa.RecordBatch) -> None:
        """Task: write one Arrow batch inside the transaction."""

    @abstractmethod
    def pre_commit(self, transaction: TxnT) -> Committable:
        """Task: make the transaction durable but invisible (PREPARE), return its committable."""

    @abstractmethod
    def abort_open(self, transaction: TxnT) -> None:
        """Task: roll back a transaction that failed before ``pre_commit``."""

    @abstractmethod
    def commit(self, committable: Committable) -> CommitOutcome:
        """Driver: commit a pre-committed transaction. Must be idempotent: a transaction
        committed before answers ALREADY_COMMITTED; one that cannot be committed raises CommitError."""

    @abstractmethod
    def abort(self, committable: Committable) -> CommitOutcome:
        """Driver: abort a pre-committed transaction; ALREADY_ABORTED when it is gone."""

    def recover_and_commit(self, committable: Committable) -> CommitOutcome:
        """Recovery: commit what belongs to a completed checkpoint, whether or not it was committed."""
        return self.commit(committable)

    def recover_and_abort(self, committable: Committable) -> CommitOutcome:
        """Recovery: abort what belongs to a checkpoint that never completed."""
        return self.abort(committable)

    def committed_before(self, task: TaskInfo) -> bool:
        """Task: whether the target holds a committed transaction of (sink, batch, partition)
        already (another run committed the batch while this one replayed it). The default
        cannot tell."""
        return False

    def write_partition(self, task: TaskInfo, batches: Iterator[pa.RecordBatch]) -> list[Committable]:
        if self.committed_before(task):
            logger.warning("sink %s batch %s partition %s: committed by another run already; this attempt writes "
                           "nothing", self.sink_id, task.batch_id, task.partition_id)
            for _ in batches:
                pass
            return []
        transaction = self.begin_transaction(task)
        try:
            for batch in batches:
                self.write(transaction, batch)
        except BaseException:
            self.abort_open(transaction)
            raise
        return [self.pre_commit(transaction)]

    def commit_batch(self, batch_id: int, committables: Sequence[Committable]) -> None:
        for index, committable in enumerate(committables):
            if index:
                crash_point("mid_commit", batch_id)
            outcome = self.recover_and_commit(committable)
            logger.info("sink %s batch %s partition %s txn %s: %s", self.sink_id, batch_id,
                        committable.partition_id, committable.transaction_id, outcome.value)

    def abort_batch(self, batch_id: int, committables: Sequence[Committable]) -> None:
        for committable in committables:
            outcome = self.recover_and_abort(committable)
            logger.info("sink %s batch %s partition %s txn %s: %s", self.sink_id, batch_id,
                        committable.partition_id, committable.transaction_id, outcome.value)


class WriteAheadSink(Sink):
    """Flink's GenericWriteAheadSink: stage, then send the staged values on completion and record
    the checkpoint in a checkpoint committer in the same transaction. Staging, discarding and
    finding leftovers are done here, on :class:`~oncekit.core.staging.StagedFiles`; a subclass
    writes ``send_values`` only, reading the batch through :meth:`staged_batches`."""

    protocol = "write-ahead-log"
    staged: StagedFiles

    @abstractmethod
    def send_values(self, batch_id: int, committables: Sequence[Committable]) -> CommitOutcome:
        """Driver: write every staged row of the batch to the target and record (sink, batch) in
        the checkpoint committer, atomically. ALREADY_COMMITTED when the batch is recorded."""

    def staged_batches(self, batch_id: int, committables: Sequence[Committable]) -> Iterator[tuple[Committable, Iterator[pa.RecordBatch]]]:
        """For ``send_values``: each staged file with its Arrow batches, with the ``mid_commit``
        crash point between two files."""
        for index, committable in enumerate(committables):
            if index:
                crash_point("mid_commit", batch_id)
            yield committable, self.staged.read(committable)

    def write_partition(self, task: TaskInfo, batches: Iterator[pa.RecordBatch]) -> list[Committable]:
        staged = self.staged.stage(task, batches)
        return [] if staged is None else [staged]

    def commit_batch(self, batch_id: int, committables: Sequence[Committable]) -> None:
        outcome = self.send_values(batch_id, committables) if committables else CommitOutcome.ALREADY_COMMITTED
        self.staged.discard(committables)
        logger.info("sink %s batch %s: %s rows in %s staged files %s", self.sink_id, batch_id,
                    sum(c.rows for c in committables), len(committables), outcome.value)

    def abort_batch(self, batch_id: int, committables: Sequence[Committable]) -> None:
        self.staged.discard(committables)
        logger.info("sink %s batch %s: discarded %s staged files", self.sink_id, batch_id, len(committables))

    def leftovers(self, batch_ids: Iterable[int] | None = None) -> list[Committable]:
        return self.staged.leftovers(batch_ids)


class IdempotentSink(Sink):
    """Writes with deterministic keys inside the task and commits; a replay rewrites the same rows."""

    protocol = "idempotent"

    @abstractmethod
    def upsert(self, task: TaskInfo, batches: Iterator[pa.RecordBatch]) -> int:
        """Task: write and commit the partition; return the number of rows written."""

    def write_partition(self, task: TaskInfo, batches: Iterator[pa.RecordBatch]) -> list[Committable]:
        self.upsert(task, batches)
        return []


class TaskCommitSink(Sink):
    """Each task commits its own transaction together with a marker of its (sink, batch,
    partition); a replayed batch finds the marker and writes nothing."""

    protocol = "transactional"

    @property
    def commits_in_task(self) -> bool:
        return True

    @abstractmethod
    def commit_task(self, task: TaskInfo, batches: Iterator[pa.RecordBatch]) -> int:
        """Task: write the partition and its batch marker in one transaction and commit it, or
        write nothing when the marker shows the batch committed; return the rows written."""

    def write_partition(self, task: TaskInfo, batches: Iterator[pa.RecordBatch]) -> list[Committable]:
        self.commit_task(task, batches)
        return []


class AtLeastOnceSink(Sink):
    """Tasks write and commit at once; a batch re-run after a crash writes its rows again."""

    protocol = "at-least-once"
    guarantee = DeliveryGuarantee.AT_LEAST_ONCE

    @abstractmethod
    def append(self, task: TaskInfo, batches: Iterator[pa.RecordBatch]) -> int:
        """Task: write and commit (or flush) the partition; return the number of rows written."""

    def write_partition(self, task: TaskInfo, batches: Iterator[pa.RecordBatch]) -> list[Committable]:
        self.append(task, batches)
        return []


class SinkConfig(ABC):
    """A sink's configuration: picklable, frozen, free of open connections. It travels as Spark
    string options (for ``df.writeStream.format(...)``) and builds the sink object in whichever
    process needs it: the driver's Python worker, an executor's task, or the user's driver
    process (the listener)."""

    format_name: ClassVar[str]
    sink_id: str
    protocol: str

    def _check_common(self, protocols: tuple[str, ...], target: str, default_id: str) -> None:
        """Called from a subclass's ``__post_init__``: the protocol is known, the target is given,
        and the sink id (which names transactions, journal folders and marker topics) is safe;
        without one it is derived from the target."""
        if self.protocol not in protocols:
            raise ConfigError(f"{self.format_name}: unknown protocol {self.protocol!r}; choose one of {', '.join(protocols)}")
        if not target:
            raise ConfigError(f"{self.format_name}: the target (table or topic) is required")
        if not self.sink_id:
            object.__setattr__(self, "sink_id", re.sub(r"[^A-Za-z0-9_.-]", "_", default_id))
        if not _SINK_ID.match(self.sink_id):
            raise ConfigError(f"{self.format_name}: sink id {self.sink_id!r} may hold only letters, digits, '_', '.', '-'")

    @property
    def guarantee(self) -> DeliveryGuarantee:
        return DeliveryGuarantee.AT_LEAST_ONCE if self.protocol == "at-least-once" else DeliveryGuarantee.EXACTLY_ONCE

    @abstractmethod
    def build(self, checkpoint: str) -> Sink:
        """Create the sink object for a query whose checkpoint is at ``checkpoint``."""

    @abstractmethod
    def to_options(self) -> dict[str, str]:
        """Spark string options that :meth:`from_options` turns back into this configuration."""

    @classmethod
    @abstractmethod
    def from_options(cls, options: Mapping[str, str], columns: tuple[str, ...]) -> SinkConfig:
        """Parse Spark's (lower-cased) options; ``columns`` are the stream's column names."""

    @classmethod
    @abstractmethod
    def data_source(cls) -> type:
        """The PySpark ``DataSource`` class of ``format_name``, which ``start_query`` registers.
        Imports pyspark: called only where a SparkSession exists."""

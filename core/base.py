"""The sink protocols: what a sink implements so that the checkpoint engine can make it exactly-once.

Three shapes, after Flink:

- :class:`TwoPhaseCommitSink`: tasks ``begin_transaction``, ``write``, ``pre_commit`` (returning a
  committable); once the checkpoint is complete the engine calls ``commit``; after a crash it
  calls ``recover_and_commit`` or ``recover_and_abort``. *A commit must be idempotent.*
- :class:`WriteAheadSink`: tasks stage their rows durably under the checkpoint; once the checkpoint
  is complete the engine calls ``send_values`` for the whole batch, which writes the values and
  records the checkpoint in the same transaction, so a repeated call sends nothing.
- :class:`IdempotentSink`: tasks write with deterministic keys (upsert); a replay rewrites the
  same rows, so there is nothing to commit later.

A sink for another system is a subclass of one of these and nothing else; it never sees Spark.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

from oncekit.core.errors import OncekitError

if TYPE_CHECKING:
    import pyarrow as pa

    from oncekit.core.staging import StagedFiles

logger = logging.getLogger(__name__)


class DeliveryGuarantee(enum.Enum):
    """What a sink promises about each input record's effect on the target after failures."""

    AT_MOST_ONCE = "at-most-once"
    AT_LEAST_ONCE = "at-least-once"
    EXACTLY_ONCE = "exactly-once"

    @classmethod
    def parse(cls, value: str | DeliveryGuarantee) -> DeliveryGuarantee:
        if isinstance(value, DeliveryGuarantee):
            return value
        normalized = value.strip().lower().replace("_", "-")
        for member in cls:
            if member.value == normalized:
                return member
        from oncekit.core.errors import ConfigError

        raise ConfigError(f"unknown delivery guarantee {value!r}; choose at-most-once, at-least-once or exactly-once")


class CommitOutcome(enum.Enum):
    """How a commit or abort request ended. Anything else raises a named error."""

    COMMITTED = "committed"
    ALREADY_COMMITTED = "already committed"
    ABORTED = "aborted"
    ALREADY_ABORTED = "already aborted"


class CommitError(OncekitError):
    """A committable could not be committed and was not committed before (for example, a
    prepared transaction vanished without its marker: someone rolled it back)."""


@dataclass(frozen=True)
class TaskInfo:
    """Where a task writes: the sink, the checkpoint (= Spark batch id), the partition, and the
    attempt (Spark's task attempt id: unique among all task attempts of the application)."""

    sink_id: str
    batch_id: int
    partition_id: int
    attempt: int

    @property
    def transaction_id(self) -> str:
        """Deterministic per (sink, batch, partition, attempt): a retried task gets a new id, a
        replayed batch after a restart reuses it (the old one is aborted before)."""
        return f"oncekit:{self.sink_id}:{self.batch_id}:{self.partition_id}:{self.attempt}"


@dataclass(frozen=True)
class Committable:
    """What a task pre-committed, journaled by the driver, committed once the checkpoint completes.

    ``transaction_id`` names the open transaction (two-phase commit) or the staged file
    (write-ahead log). Frozen and JSON-serializable: the journal stores it as a dict.
    """

    sink_id: str
    batch_id: int
    partition_id: int
    attempt: int
    transaction_id: str
    rows: int

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Committable:
        return cls(**data)


TxnT = TypeVar("TxnT")


class Sink(ABC):
    """The engine's view of every sink. Subclass one of the three protocols below, not this."""

    protocol: ClassVar[str]
    sink_id: str
    guarantee: DeliveryGuarantee

    def preflight(self) -> None:
        """Driver, once per query start: check the target (tables, server settings) and raise a
        ConfigError that says what to fix. The default checks nothing."""

    @abstractmethod
    def write_partition(self, task: TaskInfo, batches: Iterator[pa.RecordBatch]) -> Committable | None:
        """Task: write one partition of one batch; return what the driver must journal, if anything."""

    def commit_batch(self, batch_id: int, committables: Sequence[Committable], crash: Any = None) -> None:
        """Driver (or listener): make a completed checkpoint's output visible. Idempotent.
        ``crash`` is the engine's crash hook, called between two committables."""

    def abort_batch(self, batch_id: int, committables: Sequence[Committable]) -> None:
        """Driver: discard what an incomplete checkpoint pre-committed. Idempotent."""

    def leftovers(self, batch_ids: Iterable[int] | None = None) -> list[Committable]:
        """Driver: what the target still holds open for this sink (prepared transactions,
        staged files), for batches in ``batch_ids`` or all. Recovery aborts those no journal
        names. The default holds nothing open."""
        return []

    def close(self) -> None:
        """Release connections; called when the engine is done with the sink."""


class TwoPhaseCommitSink(Sink, Generic[TxnT]):
    """Flink's TwoPhaseCommitSinkFunction, snake_case: transactions that survive the task."""

    protocol = "two-phase-commit"

    @abstractmethod
    def begin_transaction(self, task: TaskInfo) -> TxnT:
        """Task: open a transaction named ``task.transaction_id``; first abort what earlier
        attempts or runs left open for the same (sink, batch, partition)."""

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

    def write_partition(self, task: TaskInfo, batches: Iterator[pa.RecordBatch]) -> Committable:
        transaction = self.begin_transaction(task)
        try:
            for batch in batches:
                self.write(transaction, batch)
        except BaseException:
            self.abort_open(transaction)
            raise
        return self.pre_commit(transaction)

    def commit_batch(self, batch_id: int, committables: Sequence[Committable], crash: Any = None) -> None:
        for index, committable in enumerate(committables):
            if index and crash is not None:
                crash("mid_commit", batch_id)
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
    writes ``send_values`` only."""

    protocol = "write-ahead-log"
    staged: StagedFiles

    @abstractmethod
    def send_values(self, batch_id: int, committables: Sequence[Committable], crash: Any = None) -> CommitOutcome:
        """Driver: write every staged row of the batch to the target and record (sink, batch) in
        the checkpoint committer, atomically. ALREADY_COMMITTED when the batch is recorded.
        ``crash`` is the engine's crash hook, called between two staged files."""

    def write_partition(self, task: TaskInfo, batches: Iterator[pa.RecordBatch]) -> Committable | None:
        return self.staged.stage(task, batches)

    def commit_batch(self, batch_id: int, committables: Sequence[Committable], crash: Any = None) -> None:
        outcome = self.send_values(batch_id, committables, crash) if committables else CommitOutcome.ALREADY_COMMITTED
        self.staged.discard(committables)
        logger.info("sink %s batch %s: %s rows in %s staged files %s", self.sink_id, batch_id,
                    sum(c.rows for c in committables), len(committables), outcome.value)

    def abort_batch(self, batch_id: int, committables: Sequence[Committable]) -> None:
        self.staged.discard(committables)
        logger.info("sink %s batch %s: discarded %s staged files", self.sink_id, batch_id, len(committables))

    def leftovers(self, batch_ids: Iterable[int] | None = None) -> list[Committable]:
        return self.staged.leftovers(batch_ids)


class IdempotentSink(Sink):
    """Writes with deterministic keys inside the task; a replay rewrites the same rows."""

    protocol = "idempotent"

    @abstractmethod
    def upsert(self, task: TaskInfo, batches: Iterator[pa.RecordBatch]) -> int:
        """Task: write and commit the partition; return the number of rows written."""

    def write_partition(self, task: TaskInfo, batches: Iterator[pa.RecordBatch]) -> Committable | None:
        self.upsert(task, batches)
        return None

"""The protocol bases, after Flink: what a sink for another system subclasses (one of these,
nothing else). The contract they fulfil is :class:`~oncekit.core.protocol.Sink`.

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
"""

from __future__ import annotations

import logging
from abc import abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, ClassVar, Generic, TypeVar

from oncekit.core.crash import crash_point
from oncekit.core.protocol import CommitOutcome, Committable, DeliveryGuarantee, Sink, TaskInfo

if TYPE_CHECKING:
    import pyarrow as pa

    from oncekit.core.staging import StagedFiles

logger = logging.getLogger(__name__)

TxnT = TypeVar("TxnT")


class TwoPhaseCommitSink(Sink, Generic[TxnT]):
    """Flink's TwoPhaseCommitSinkFunction, snake_case: transactions that survive the task. A
    prepared transaction holds what a replay of its partition needs, so its decisions are fenced
    at the target (:meth:`~oncekit.core.protocol.Sink.decide`)."""

    protocol = "two-phase-commit"
    blocking_pre_commits: ClassVar[bool] = True

    @abstractmethod
    def begin_transaction(self, task: TaskInfo) -> TxnT:
        """Task: open a transaction named ``task.transaction_id``; first abort what an earlier
        attempt left open for the same (sink, batch, partition): one of an older run (whose
        decisions the target refuses since this run took its epoch, and whose decided batches
        this run's recovery committed), or one of this run with a lower attempt id (Spark numbers
        attempts in the order it starts them, so a zombie attempt never aborts the attempt that
        replaced it). Never a newer run's (:func:`stale_for`)."""

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
        """Task: whether a run committed the task's batch already (this is a replay of a batch
        another run decided), so that the task writes nothing. The default cannot tell."""
        return False

    def write_partition(self, task: TaskInfo, batches: Iterator[pa.RecordBatch]) -> list[Committable]:
        if self.committed_before(task):
            logger.warning("sink %s batch %s partition %s: a run committed the batch already; this attempt writes "
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
        self.staged.drop(batch_id)
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


def stale_for(task: TaskInfo, held: Committable) -> bool:
    """Whether ``held`` (open in the target for the same sink, batch and partition as ``task``) is
    one ``task`` may abort when it begins: an older run's, or an earlier attempt of its own run."""
    return held.epoch < task.epoch or (held.epoch == task.epoch and held.attempt < task.attempt)

"""PostgreSQL two-phase commit: tasks PREPARE a transaction per partition, the driver COMMITs
PREPARED once the checkpoint completes. Needs ``max_prepared_transactions`` > 0 on the server."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

import pyarrow as pa

from oncekit.core.bases import TwoPhaseCommitSink, stale_for
from oncekit.core.errors import CommitError
from oncekit.core.protocol import CommitOutcome, Committable, TaskInfo
from oncekit.sinks.postgres._common import DECISION_TABLE, FORMAT, MARKER_TABLE, PostgresSinkBase
from oncekit.sinks.postgres._target import PreparingTransaction

logger = logging.getLogger(__name__)


class PostgresTwoPhaseCommitSink(PostgresSinkBase, TwoPhaseCommitSink[PreparingTransaction]):
    """Tasks prepare, the driver commits prepared. A marker row in each prepared transaction tells
    "committed" from "rolled back" once the id has left ``pg_prepared_xacts``; its unique key per
    (sink, batch, partition) lets at most one transaction of a batch's partition commit, whichever
    run prepared it, and a second one waits for the first to finish (a lock wait that gives up
    after the pool's lock timeout) before it can prepare. A run's decision of a batch is a row of
    ``oncekit_decisions``, inserted under the sink's epoch, so a superseded run's decision is
    refused in the same transaction that would record it."""

    BATCH_RECORDS = (MARKER_TABLE, DECISION_TABLE)

    def committed_before(self, task: TaskInfo) -> bool:
        """Whether a run decided the task's batch: a decided batch is final and whole (its
        decision came after every task of its run prepared, and recovery commits it), so none of
        its replay's tasks writes, however the replay splits the batch into partitions
        (decisions of forgotten batches are gone, and Spark never runs those again)."""
        return bool(self.target.decisions([task.batch_id])[task.batch_id])

    def begin_transaction(self, task: TaskInfo) -> PreparingTransaction:
        for held in self.target.prepared([task.batch_id]):
            if held.partition_id == task.partition_id and stale_for(task, held):
                logger.info("sink %s batch %s partition %s txn %s: aborting stale attempt", self.sink_id,
                            task.batch_id, task.partition_id, held.transaction_id)
                self.target.finish_prepared(held.name, commit=False)
        logger.info("sink %s batch %s partition %s txn %s: begin", self.sink_id, task.batch_id, task.partition_id,
                    task.transaction_id)
        return self.target.begin(task)

    def write(self, transaction: PreparingTransaction, batch: pa.RecordBatch) -> None:
        transaction.write(batch)

    def pre_commit(self, transaction: PreparingTransaction) -> Committable:
        task = transaction.task
        rows = transaction.prepare()
        logger.info("sink %s batch %s partition %s txn %s: prepared %s rows", self.sink_id, task.batch_id,
                    task.partition_id, task.transaction_id, rows)
        return Committable(task.sink_id, task.batch_id, task.partition_id, task.attempt, rows,
                           transaction_id=task.transaction_id, epoch=task.epoch)

    def abort_open(self, transaction: PreparingTransaction) -> None:
        transaction.abort()

    def commit(self, committable: Committable) -> CommitOutcome:
        if self.target.finish_prepared(committable.name, commit=True):
            return CommitOutcome.COMMITTED
        if self.target.marker_visible(committable.name):
            return CommitOutcome.ALREADY_COMMITTED
        raise CommitError(
            f"{FORMAT} sink {self.sink_id} batch {committable.batch_id} partition {committable.partition_id}: "
            f"prepared transaction {committable.transaction_id} is gone and its marker is not visible: "
            "it was rolled back, so the checkpoint's output for this partition is lost"
        )

    def abort(self, committable: Committable) -> CommitOutcome:
        if self.target.finish_prepared(committable.name, commit=False):
            return CommitOutcome.ABORTED
        if self.target.marker_visible(committable.name):
            raise CommitError(f"{FORMAT} sink {self.sink_id}: transaction {committable.transaction_id} was to be "
                              "aborted but is committed")
        return CommitOutcome.ALREADY_ABORTED

    def leftovers(self, batch_ids: Iterable[int] | None = None) -> list[Committable]:
        """Prepared transactions of this sink in this database (``pg_prepared_xacts``)."""
        return self.target.prepared(batch_ids)

    def decide(self, batch_id: int, committables: Sequence[Committable]) -> None:
        if self.target.decide(batch_id, self.epoch, "decided") != "decided":
            raise CommitError(f"{FORMAT} sink {self.sink_id} batch {batch_id}: this run (epoch {self.epoch}) gave the "
                              "batch up before its driver commit came; nothing of it is decided, and it is replayed")

    def decided(self, batch_ids: Iterable[int]) -> dict[int, set[int]]:
        return self.target.decisions(batch_ids)

    def veto(self, batch_id: int) -> bool:
        return self.target.decide(batch_id, self.epoch, "vetoed") == "vetoed"

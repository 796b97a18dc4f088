"""The checkpoint engine: ties a sink's commits to Spark's checkpoint completion.

The commit sequence of one batch N (checkpoint id = Spark batch id):

1. Tasks pre-commit (prepare a transaction, stage rows) and return committables
   (:meth:`CheckpointEngine.write_task`).
2. Spark calls the stream writer's driver-side commit; :meth:`CheckpointEngine.checkpoint`
   journals the committables under ``<checkpoint>/oncekit/<sink>/`` and returns.
3. Spark writes ``commits/N``: the checkpoint is complete.
4. A notification for N commits every journaled batch up to N that Spark logged as committed
   (:meth:`CheckpointEngine.complete`): from the query listener, from a later batch's step 2,
   or when the query stops. Notifications may be late, repeated or lost; commits are idempotent.
5. Recovery (:meth:`CheckpointEngine.recover`) runs in the first stream writer Spark creates on
   the driver after a query start (every writer, for a query started without
   :func:`~oncekit.core.spark.query.start_query`): it commits what belongs to completed
   checkpoints, aborts what belongs to checkpoints that did not complete, and aborts leftovers
   of failed task attempts and earlier runs.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from oncekit.core.protocol import Committable, Sink, SinkConfig, SinkOwner, TaskInfo
from oncekit.core.crash import crash_point
from oncekit.core.errors import CommitError, FencedError
from oncekit.core.journal import Journal
from oncekit.core.lease import QueryLease
from oncekit.core.spark_log import SparkLog

if TYPE_CHECKING:
    import pyarrow as pa

logger = logging.getLogger(__name__)


@dataclass
class RecoveryReport:
    committed_batches: list[int] = field(default_factory=list)
    aborted_batches: list[int] = field(default_factory=list)
    aborted_leftovers: list[str] = field(default_factory=list)


class CheckpointEngine:
    """Driver-side coordination of one sink of one query; the task side is :meth:`write_task`.

    Safe to run from several processes at once (listener, driver worker, tasks): every step is
    idempotent, and recovery never touches what a running batch may still commit.
    """

    def __init__(self, sink: Sink, checkpoint: str, epoch: int = 0) -> None:
        self.sink = sink
        self.spark_log = SparkLog(checkpoint)
        self.location = checkpoint
        self.journal = Journal(checkpoint, sink.sink_id)
        self.epoch = epoch
        sink.act_for(epoch)

    @classmethod
    def of(cls, config: SinkConfig, checkpoint: str, epoch: int = 0) -> CheckpointEngine:
        """The engine of the sink ``config`` describes, for the query checkpointed at
        ``checkpoint``, acting for the query run of ``epoch``."""
        return cls(config.build(checkpoint), checkpoint, epoch)

    def preflight(self) -> None:
        """Driver, once per query start (the stream writer): the sink's checks, then whether the
        sink id is free for this checkpoint's query
        (:meth:`~oncekit.core.protocol.Sink.refuse_claimed`)."""
        self.sink.preflight(resumed=self.journal.run() is not None)
        owner = self._owner()
        if owner is not None:
            self.sink.refuse_claimed(owner, owner_in_use)

    def start_run(self, token: str) -> RecoveryReport:
        """Driver, the first stream writer of query run ``token``, after :meth:`preflight`: take
        the run's epoch (the sink's fencing token: above every earlier run's, recorded in the
        target, :meth:`~oncekit.core.protocol.Sink.take_epoch`), recover under it, claim the sink
        id for this checkpoint's query (:meth:`~oncekit.core.protocol.Sink.claim`), then record
        the run. From the epoch on, the target refuses every older run's acts, and this run's
        aborts touch nothing of a newer run's."""
        epoch = self.sink.take_epoch(self.journal.latest_epoch())
        self.epoch = epoch
        self.sink.act_for(epoch)
        logger.info("sink %s: run %s takes epoch %s", self.sink.sink_id, token, epoch)
        report = self.recover()
        owner = self._owner()
        if owner is not None:
            self.sink.claim(owner)
        self.journal.record_epoch(token, epoch)
        self.journal.start_run(token)
        return report

    def _owner(self) -> SinkOwner | None:
        """This checkpoint's query as the sink's owner; None before Spark wrote the query's id
        (it does before it creates the writer; a test harness may not)."""
        query_id = self.spark_log.query_id()
        return None if query_id is None else SinkOwner(query_id, self.location)

    def refuse_superseded(self, where: str) -> None:
        """Driver: FencedError when a newer run than this engine's took the sink. A check for a
        named error early; what makes an older run harmless is the target's refusal and
        :meth:`_may_touch`."""
        latest = self.journal.latest_epoch()
        if self.epoch and latest > self.epoch:
            raise FencedError(f"sink {self.sink.sink_id} {where}: this run (epoch {self.epoch}) was superseded by epoch "
                              f"{latest}: another driver took the query over")

    def _may_touch(self, committable: Committable) -> bool:
        """Whether this run may abort ``committable``: its own or an older run's, never a newer
        run's (an engine without an epoch is unfenced: anything)."""
        return not self.epoch or committable.epoch <= self.epoch

    # -- task side ---------------------------------------------------------------------------

    def write_task(self, task: TaskInfo, batches: Iterator[pa.RecordBatch]) -> list[Committable]:
        """Task: write one partition of one batch through the sink, with the task crash points."""
        crash_point("task_before_write", task.batch_id, task.partition_id)
        committables = self.sink.write_partition(task, batches)
        crash_point("task_after_pre_commit", task.batch_id, task.partition_id)
        return committables

    # -- driver side -------------------------------------------------------------------------

    def checkpoint(self, batch_id: int, committables: Sequence[Committable], notified: bool = False) -> None:
        """Driver, in the stream writer's commit for ``batch_id``, before Spark's commit log:
        catch up on earlier completed checkpoints, journal this one, abort what lost attempts
        left open (of this batch, and strays of earlier ones: a killed task on a slow executor
        can prepare after its batch's sweep), forget what no recovery can need any more
        (:meth:`_prune`). A batch with nothing to commit later is journaled too: its
        checkpoint-complete notification is still the sink's to hear (and the crash points' to
        test). Refuses to journal a committable that is no longer held open (CommitError).

        When ``notified`` (a listener or the run's committer delivers notifications), the previous
        batch is left to it: it is most likely committing that batch right now, and two committers
        of one batch fence each other (Kafka) or wait on each other's locks (PostgreSQL). The
        catch-up then reaches only the batch before.

        Of a run that a newer one superseded: FencedError, and nothing journaled."""
        self.refuse_superseded(f"batch {batch_id}")
        self.complete(batch_id - (2 if notified else 1))
        held = [c for c in self.sink.leftovers() if c.batch_id <= batch_id]
        missing = sorted(c.name for c in committables if c.key not in {h.key for h in held})
        if missing:
            # Journaled, they could never be committed, and Spark would log the batch complete
            # without them: its output for those partitions would be lost.
            raise CommitError(
                f"sink {self.sink.sink_id} batch {batch_id}: pre-committed {', '.join(missing)} no longer held before the "
                "checkpoint (another attempt of the task aborted it: spark.speculation, or a stage retried while "
                "the old attempt still ran); nothing of the batch is journaled, so it fails and is replayed")
        self.journal.write(batch_id, committables, self.epoch)
        logger.info("sink %s batch %s: journaled %s committables", self.sink.sink_id, batch_id, len(committables))
        crash_point("driver_after_journal", batch_id)
        journaled, done = self.journal.entries()
        for held_batch in sorted({c.batch_id for c in held}):
            # What a journal entry names stays (the listener or the catch-up commits it, maybe
            # right now); anything else held open is an attempt no journal names.
            try:
                named = committables if held_batch == batch_id else \
                    self.journal.read(held_batch) if held_batch in journaled else []
            except FileNotFoundError:
                continue  # pruned meanwhile: committed; look again at the next batch
            kept = {c.key for c in named}
            lost = [c for c in held if c.batch_id == held_batch and c.key not in kept and self._may_touch(c)]
            if lost:
                self.sink.abort_batch(held_batch, lost)
        self._prune(self.spark_log.completed(), journaled, done)  # recovery runs once per query start

    def abort(self, batch_id: int, committables: Sequence[Committable]) -> None:
        """Driver, in the stream writer's abort: Spark gave up on ``batch_id``. Aborts what this
        run's tasks (or older runs') left open for the batch, never a newer run's."""
        leftovers = [c for c in self.sink.leftovers([batch_id]) if self._may_touch(c)]
        known = {c.key for c in committables}
        self.sink.abort_batch(batch_id, [*committables, *(c for c in leftovers if c.key not in known)])

    def abort_unfinished(self) -> list[str]:
        """Driver, once its query has stopped or failed: abort what this run (its epoch; nothing
        for an unfenced engine) holds open that no commit will make visible: all it holds of
        batches Spark did not complete (the next start replays them), and of completed batches
        what their journal entries do not name (attempts that lost, such as a killed task that
        pre-committed after its batch's sweep). Returns their names."""
        if not self.epoch:
            return []
        journaled, _ = self.journal.entries()  # before the leftovers: an entry pruned after them was committed
        completed = self.spark_log.completed()
        mine = [c for c in self.sink.leftovers() if c.epoch == self.epoch]
        lost: list[Committable] = []
        for batch_id in sorted({c.batch_id for c in mine}):
            held = [c for c in mine if c.batch_id == batch_id]
            if is_complete(batch_id, completed):
                try:
                    named = {c.key for c in self.journal.read(batch_id)} if batch_id in journaled else set()
                except FileNotFoundError:
                    continue  # pruned meanwhile: committed, and what it named with it
                held = [c for c in held if c.key not in named]
            if held:
                self.sink.abort_batch(batch_id, held)
                lost += held
        return [c.name for c in lost]

    def complete(self, up_to: int | None = None) -> list[int]:
        """Checkpoint-complete notification: commit every journaled, not yet committed batch
        up to ``up_to`` (all if None) that Spark logged as committed. Returns those batch ids."""
        committed = self.uncommitted(up_to)
        for batch_id in committed:
            self._commit(batch_id)
        return committed

    def uncommitted(self, up_to: int | None = None) -> list[int]:
        """The journaled batches up to ``up_to`` (all if None) that Spark logged as committed
        and the sink has not committed yet: what :meth:`complete` would commit."""
        journaled, done = self.journal.entries()
        candidates = sorted(b for b in journaled - done if up_to is None or b <= up_to)
        if not candidates:
            return []
        return [b for b in candidates if is_complete(b, self.spark_log.completed())]

    def recover(self) -> RecoveryReport:
        """Driver, in the first stream writer of a query run (see :class:`~oncekit.core.spark.writer.QueryRun`).

        - journaled batches Spark logged as committed (or a later one: :func:`is_complete`):
          committed (recover_and_commit);
        - journaled batches Spark did not log: aborted and forgotten (Spark re-runs them);
        - open transactions or staged files no journal names: aborted, unless they belong to the
          newest planned batch while it is still running (its driver commit is about to come).

        A newer run's journal entry or open work means this run was superseded: FencedError,
        before anything is touched.
        """
        report = RecoveryReport()
        completed = self.spark_log.completed()
        latest = self.spark_log.latest_planned()
        journaled, done = self.journal.entries()
        if self.epoch:
            newer = [c.name for c in self.sink.leftovers() if c.epoch > self.epoch]
            newer += [f"journal entry of batch {b}" for b in sorted(journaled - done) if self.journal.epoch_of_entry(b) > self.epoch]
            if newer:
                raise FencedError(f"sink {self.sink.sink_id} recovery: this run (epoch {self.epoch}) was superseded: a "
                                  f"newer run wrote {', '.join(newer[:5])}")
        named: set[tuple[str, str]] = set()
        for batch_id in sorted(journaled - done):
            committables = self.journal.read(batch_id)
            if is_complete(batch_id, completed):
                self._commit(batch_id, committables)
                report.committed_batches.append(batch_id)
                named.update(c.key for c in committables)
            else:
                logger.warning("sink %s batch %s: checkpoint never completed; aborting %s committables",
                               self.sink.sink_id, batch_id, len(committables))
                self.sink.abort_batch(batch_id, committables)
                self.journal.delete(batch_id)
                report.aborted_batches.append(batch_id)
        orphans = [
            c for c in self.sink.leftovers()
            if c.key not in named and not (c.batch_id == latest and c.batch_id not in completed)
        ]
        for batch_id in sorted({c.batch_id for c in orphans}):
            lost = [c for c in orphans if c.batch_id == batch_id]
            self.sink.abort_batch(batch_id, lost)
            report.aborted_leftovers.extend(c.name for c in lost)
        self._prune(completed, journaled, done)
        return report

    def _commit(self, batch_id: int, committables: Sequence[Committable] | None = None) -> None:
        crash_point("before_notify", batch_id)
        if committables is None:
            committables = self.journal.read(batch_id)
        self.sink.commit_batch(batch_id, committables)
        self.journal.mark_done(batch_id)

    def _prune(self, completed: set[int], journaled: set[int], done: set[int]) -> None:
        """Forget finished batches older than the oldest commit Spark still keeps (its
        ``minBatchesToRetain``), in the journal and in the sink: no recovery can need them. The
        sink forgets only below every batch the journal still holds unfinished."""
        if not completed:
            return
        oldest = min(completed)
        forgotten = sorted(b for b in done if b < oldest)
        for batch_id in forgotten:
            self.journal.delete(batch_id)
        if forgotten:
            self.journal.sweep(oldest)
            self.sink.forget(min([oldest, *(journaled - done)]))


def is_complete(batch_id: int, completed: set[int]) -> bool:
    """Whether Spark completed ``batch_id``: its commit file, or one of a later batch. Spark runs
    batches in order and purges old commit files (``minBatchesToRetain``); a journaled batch whose
    notification failed until its file was purged is complete all the same, and aborting it
    would lose its output."""
    return bool(completed) and batch_id <= max(completed)


def owner_in_use(current: SinkOwner, owner: SinkOwner) -> str | None:
    """Why the query ``current`` records still holds its sink id against ``owner``, or None:
    another query whose checkpoint still exists with its query id (one that cannot be read is
    taken as in use: refusing is safe, taking its sink id over is not); or the same query (a
    savepoint restored elsewhere, or the original of one) running from another checkpoint, as
    that checkpoint's lease says (:mod:`oncekit.core.lease`)."""
    if current.query_id != owner.query_id:
        found = SparkLog(current.checkpoint)
        try:
            recorded = found.query_id()
            alive = recorded == current.query_id or (recorded is None and found.exists())
        except OSError:
            alive = True
        return (f"already written by the query checkpointed at {current.checkpoint} (query id {current.query_id}). "
                "Give one of them another sink_id, or delete the other checkpoint if that query is retired"
                if alive else None)
    if current.checkpoint != owner.checkpoint:
        holder = QueryLease(current.checkpoint).holder()
        if holder is not None:
            return (f"the same query (id {current.query_id}: one checkpoint is a savepoint of the other) runs from "
                    f"{current.checkpoint} ({holder.describe()}); the two would write the same transactions and abort "
                    "each other's. Stop that query first")
    return None

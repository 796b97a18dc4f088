"""The checkpoint engine: ties a sink's commits to Spark's checkpoint completion, under the
epoch of the query run it acts for.

The commit sequence of one batch N (checkpoint id = Spark batch id):

1. Tasks pre-commit (prepare a transaction, stage rows) and return committables
   (:meth:`CheckpointEngine.write_task`).
2. Spark calls the stream writer's driver-side commit; :meth:`CheckpointEngine.checkpoint`
   journals the committables under ``<checkpoint>/oncekit/<sink>/`` in an entry of the run's own,
   and the sink makes the run's decision final at its target, fenced by the run's epoch
   (:meth:`~oncekit.core.protocol.Sink.decide`; a two-phase-commit sink only).
3. Spark writes ``commits/N``: the checkpoint is complete.
4. A notification for N commits every decided batch up to N that Spark logged as committed
   (:meth:`CheckpointEngine.complete`): from the query listener, from a later batch's step 2,
   or when the query stops. Notifications may be late, repeated or lost; commits are idempotent.
5. Recovery (:meth:`CheckpointEngine.recover`), at every run's start, right after the run took its
   epoch: it commits what was decided, and aborts what no decision names and no run can decide
   any more.

Why a decision, and not the journal entry alone, for a sink whose pre-commits hold what a replay
needs (a prepared transaction): a run that a newer one superseded may journal a batch at any
moment after the newer run looked, and its Spark may then log the batch complete. The newer run
could never tell such an entry from one that came too late, and aborting what it names would lose
the batch. The decision is refused by the target once the newer epoch is there, so the newer run,
which reads decisions after taking its epoch, sees every decision that will ever count. A
decided batch is committed even before Spark logs it complete: its replay then finds it
decided and writes nothing in any task, however it splits the batch (Spark replays a batch from
the same offsets). A sink whose pre-commits hold nothing (staged files) needs no decision:
nothing of it is deleted until its batch is done, so any entry of a completed batch can still
be committed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from oncekit.core.crash import crash_point
from oncekit.core.errors import CommitError, ConfigError, FencedError
from oncekit.core.journal import Journal
from oncekit.core.lease import QueryLease
from oncekit.core.protocol import Committable, Sink, SinkConfig, SinkOwner, TaskInfo
from oncekit.core.spark_log import SparkLog

if TYPE_CHECKING:
    import pyarrow as pa

logger = logging.getLogger(__name__)


@dataclass
class RecoveryReport:
    committed_batches: list[int] = field(default_factory=list)
    """Decided batches committed: every one Spark completed, and those decided but not completed
    of a sink whose pre-commits block a replay."""
    aborted_leftovers: list[str] = field(default_factory=list)
    """What older runs left open that no decision names."""


class CheckpointEngine:
    """Driver-side coordination of one sink of one query for one run; the task side is
    :meth:`write_task`.

    Safe to run from several processes at once (listener, driver worker, tasks) and beside other
    runs of the query: every step is idempotent, every act at a target is fenced by this run's
    epoch there, and nothing here aborts or deletes what a newer run made or what a decision
    names.
    """

    def __init__(self, sink: Sink, checkpoint: str, epoch: int = 0) -> None:
        self.sink = sink
        self.spark_log = SparkLog(checkpoint)
        self.location = checkpoint
        self.journal = Journal(checkpoint, sink.sink_id)
        self.epoch = epoch
        self._query_id: str | None = None
        sink.act_for(epoch)

    @classmethod
    def of(cls, config: SinkConfig, checkpoint: str, epoch: int = 0) -> CheckpointEngine:
        """The engine of the sink ``config`` describes, for the query checkpointed at
        ``checkpoint``, acting for the query run of ``epoch``."""
        return cls(config.build(checkpoint), checkpoint, epoch)

    @classmethod
    def for_run(cls, config: SinkConfig, checkpoint: str, token: str) -> CheckpointEngine | None:
        """The engine acting for query run ``token``'s epoch; None when the run took none (its
        first writer never got that far: it decided nothing, so there is nothing of it to commit)."""
        epoch = Journal(checkpoint, config.sink_id).epoch_of(token) if token else None
        return None if epoch is None else cls.of(config, checkpoint, epoch)

    def preflight(self, runs: Mapping[str, int] | None = None) -> None:
        """Driver, once per query start (the stream writer): the sink's checks, then whether the
        sink id is free for this checkpoint's query
        (:meth:`~oncekit.core.protocol.Sink.refuse_claimed`). ``runs``: the journal's runs, when
        the caller listed them this step (:meth:`~oncekit.core.journal.Journal.runs`)."""
        self.sink.preflight(resumed=bool(self.journal.runs() if runs is None else runs))
        owner = self._owner()
        if owner is not None:
            self.sink.refuse_claimed(owner, owner_in_use)

    def start_run(self, token: str, on_epoch: Callable[[int], object] = lambda epoch: None,
                  runs: Mapping[str, int] | None = None) -> RecoveryReport:
        """Driver, the first stream writer of query run ``token``, after :meth:`preflight`: take
        the run's epoch at the target (:meth:`~oncekit.core.protocol.Sink.take_epoch`: one
        linearizable step, so no other run holds it, and the target refuses every older run's
        acts from then on; the journal's newest epoch is its floor, from ``runs`` when the caller
        listed them this step), tell ``on_epoch`` (the run records it in the query's lease),
        record it in the journal, recover under it, then claim the sink id for this checkpoint's
        query (:meth:`~oncekit.core.protocol.Sink.claim`, fenced at the target)."""
        epoch = self.sink.take_epoch(self.journal.latest_epoch(runs))
        self.epoch = epoch
        self.sink.act_for(epoch)
        on_epoch(epoch)
        recorded = self.journal.record_epoch(token, epoch)
        logger.info("sink %s: run %s takes epoch %s", self.sink.sink_id, token, epoch)
        report = self.recover(recorded)
        owner = self._owner()
        if owner is not None:
            self.sink.claim(owner)
        return report

    def _owner(self) -> SinkOwner | None:
        """This checkpoint's query as the sink's owner; None before Spark wrote the query's id
        (it does before it creates the writer; a test harness may not)."""
        if self._query_id is None:  # Spark never changes it: read once per engine
            self._query_id = self.spark_log.query_id()
        return None if self._query_id is None else SinkOwner(self._query_id, self.location)

    def refuse_superseded(self, where: str, runs: Mapping[str, int] | None = None) -> None:
        """Driver: FencedError when a newer run than this engine's took the sink, as far as the
        journal tells (or ``runs``, its runs as the caller listed them this step). An early,
        named refusal; what makes an older run harmless is the target's refusal of its acts."""
        latest = self.journal.latest_epoch(runs)
        if latest > self.epoch:
            raise FencedError(f"sink {self.sink.sink_id} {where}: this run (epoch {self.epoch}) was superseded by epoch "
                              f"{latest}: another driver took the query over")

    def _require_epoch(self, where: str) -> None:
        if not self.epoch:
            raise ConfigError(f"sink {self.sink.sink_id} {where}: the engine acts for no query run (epoch 0); "
                              "take the run's epoch first (start_run), or build it for the run (for_run)")

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
        catch up on earlier completed checkpoints, journal this one in the run's own entry, have
        the sink make the decision final at the target (fenced: FencedError for a superseded run,
        whose entry then counts for nothing and whose batch Spark does not log), then, where
        pre-commits block a replay, abort what this run's lost attempts left open (of this batch,
        and strays of earlier ones that this run decided: a killed task on a slow executor can
        pre-commit after its batch's sweep) and what older runs' stragglers prepared since this
        run started (none of it can be decided). Refuses to journal such a committable that is no
        longer held open (CommitError). Staged files are left to their batch's commit, which
        deletes every file of the batch, and to the next run's recovery.

        When ``notified`` (a listener or the run's committer delivers notifications), the previous
        batch is left to it: it is most likely committing that batch right now, and two committers
        of one batch fence each other (Kafka) or wait on each other's locks (PostgreSQL). The
        catch-up then reaches only the batch before."""
        self._require_epoch(f"batch {batch_id}")
        self.refuse_superseded(f"batch {batch_id}")
        names = self.journal.listing()
        self.complete(batch_id - (2 if notified else 1), names)
        held = self._leftovers(batch_id, blocking_only=True)
        blocking = {t.sink_id for t in self.sink.targets() if t.blocking_pre_commits}
        missing = sorted(c.name for c in committables if c.sink_id in blocking and c.key not in {h.key for h in held})
        if missing:
            # Journaled, they could never be committed, and Spark would log the batch complete
            # without them: its output for those partitions would be lost.
            raise CommitError(
                f"sink {self.sink.sink_id} batch {batch_id}: pre-committed {', '.join(missing)} no longer held before the "
                "checkpoint (another attempt of the task aborted it: spark.speculation, or a stage retried while "
                "the old attempt still ran); nothing of the batch is journaled, so it fails and is replayed")
        self.journal.write(batch_id, committables, self.epoch, names)
        for target in self.sink.targets():
            target.decide(batch_id, [c for c in committables if c.sink_id == target.sink_id])
        logger.info("sink %s batch %s: journaled and decided %s committables (epoch %s)", self.sink.sink_id, batch_id,
                    len(committables), self.epoch)
        crash_point("driver_after_journal", batch_id)
        # Older runs' pre-commits that block a replay: no older run can decide anything since
        # this one took its epoch, and this run's recovery committed what they had decided.
        older = [c for c in held if c.epoch < self.epoch]
        for held_batch in sorted({c.batch_id for c in older}):
            self._abort(held_batch, [c for c in older if c.batch_id == held_batch])
        mine = [c for c in held if c.epoch == self.epoch]
        for held_batch in sorted({c.batch_id for c in mine}):
            named = committables if held_batch == batch_id else self.journal.read_all(held_batch, names).get(self.epoch)
            if named is None:
                continue  # a batch this run never decided: its stop or the next run settles it
            kept = {c.key for c in named}
            self._abort(held_batch, [c for c in mine if c.batch_id == held_batch and c.key not in kept])

    def abort(self, batch_id: int, committables: Sequence[Committable]) -> None:
        """Driver, in the stream writer's abort: Spark gave up on ``batch_id`` in this run. Of what
        this run's tasks left open for the batch, a sink whose pre-commits block a replay aborts
        all once the batch is closed to this run's decisions (:meth:`~oncekit.core.protocol.Sink.veto`),
        or, if this run decided it already, what the decision does not name. Staged files wait
        until their batch is done. Never touches another run's."""
        self._require_epoch(f"batch {batch_id} abort")
        held = [*committables, *(c for c in self._leftovers(batch_id, blocking_only=True) if c.batch_id == batch_id)]
        self._settle_own(batch_id, [c for c in held if c.epoch == self.epoch], commit_decided=False)

    def abort_unfinished(self) -> list[str]:
        """Driver, once its query has stopped or failed for good: settle what this run holds open,
        so nothing of it is left prepared while the query is down: of each batch, what this run
        decided is committed (a decided batch is final, complete or not; its replay writes
        nothing), the rest aborted once the batch is closed to this run's decisions. Staged files
        wait until their batch is done. Returns the names of what was aborted."""
        if not self.epoch:
            return []
        mine = [c for c in self._leftovers(blocking_only=True) if c.epoch == self.epoch]
        lost: list[str] = []
        for batch_id in sorted({c.batch_id for c in mine}):
            lost += self._settle_own(batch_id, [c for c in mine if c.batch_id == batch_id], commit_decided=True)
        return lost

    def _settle_own(self, batch_id: int, held: Sequence[Committable], commit_decided: bool) -> list[str]:
        """This run's ``held`` of ``batch_id``, per target whose pre-commits block a replay:
        closed to this run's decisions, abort them; decided by this run, abort what the decision
        does not name (and with ``commit_decided``, commit what it names)."""
        aborted: list[str] = []
        for target in self.sink.targets():
            part = [c for c in held if c.sink_id == target.sink_id]
            if not part or not target.blocking_pre_commits:
                continue
            if target.veto(batch_id):
                lost = part
            else:
                decided = [c for c in self.journal.read_all(batch_id).get(self.epoch, []) if c.sink_id == target.sink_id]
                named = {c.key for c in decided}
                lost = [c for c in part if c.key not in named]
                if commit_decided and decided:
                    target.commit_batch(batch_id, decided)
            if lost:
                target.abort_batch(batch_id, _unique(lost))
                aborted += [c.name for c in _unique(lost)]
        return aborted

    def complete(self, up_to: int | None = None, names: list[str] | None = None) -> list[int]:
        """Checkpoint-complete notification: commit every journaled, not yet committed batch
        up to ``up_to`` (all if None) that Spark logged as committed, then prune by the commit
        log it read (:meth:`_prune`: every batch is committed by one such call, so the journal
        stays bounded). Returns those batch ids. ``names``: the journal's listing, when the
        caller took one this step (:meth:`~oncekit.core.journal.Journal.listing`)."""
        names = self.journal.listing() if names is None else names
        committed, completed = self._uncommitted(up_to, names)
        if committed:
            self._require_epoch("checkpoint-complete notification")
            decided = self._decided(set(committed))
            for batch_id in committed:
                self._commit(batch_id, decided, names=names)
                self.journal.mark_done(batch_id)
            self._prune(names, completed)
        return committed

    def uncommitted(self, up_to: int | None = None, names: list[str] | None = None) -> list[int]:
        """The journaled batches up to ``up_to`` (all if None) that Spark logged as committed
        and the sink has not committed yet: what :meth:`complete` would commit (``names`` as there)."""
        return self._uncommitted(up_to, names)[0]

    def _uncommitted(self, up_to: int | None, names: list[str] | None) -> tuple[list[int], set[int]]:
        """:meth:`uncommitted`, and Spark's commit log as read for it (empty when no journaled
        batch needed it)."""
        journaled, done = self.journal.entries(names)
        candidates = sorted(b for b in journaled - done if up_to is None or b <= up_to)
        if not candidates:
            return [], set()
        completed = self.spark_log.completed()
        return [b for b in candidates if is_complete(b, completed)], completed

    def recover(self, runs: Mapping[str, int] | None = None) -> RecoveryReport:
        """Driver, at the start of a query run, right after it took its epoch and recorded it
        (:meth:`start_run`; ``runs``: the journal's runs listed after that). Per target:

        - every batch Spark completed is committed from its decisions;
        - where pre-commits block a replay: a batch decided but not completed is committed too,
          and what older runs left open that no decision names is aborted (no older run can
          decide anything any more: the target refuses it since this run took its epoch);
        - staged files of batches already done are deleted; others wait for their batch.

        Work of a newer run (an entry, or something held open) means this run was superseded:
        FencedError, before anything is touched."""
        self._require_epoch("recovery")
        self.refuse_superseded("recovery", runs)
        report = RecoveryReport()
        completed = self.spark_log.completed()
        names = self.journal.listing()
        journaled, done = self.journal.entries(names)
        pending = sorted(journaled - done)
        leftovers = self._leftovers()
        newer = [c.name for c in leftovers if c.epoch > self.epoch]
        newer += [f"journal entry of batch {b}" for b, epochs in self.journal.epochs_of(set(pending), names).items()
                  if max(epochs, default=0) > self.epoch]
        if newer:
            raise FencedError(f"sink {self.sink.sink_id} recovery: this run (epoch {self.epoch}) was superseded: a "
                              f"newer run wrote {', '.join(newer[:5])}")
        decided = self._decided(set(pending))
        named: set[tuple[str, str]] = set()
        finished = set(done)
        for batch_id in pending:
            complete = is_complete(batch_id, completed)
            kept, committed = self._commit(batch_id, decided, early=not complete, names=names)
            named |= kept
            if complete:
                self.journal.mark_done(batch_id)
                finished.add(batch_id)
            if committed:
                report.committed_batches.append(batch_id)
        for target in self.sink.targets():
            held = [c for c in leftovers if c.sink_id == target.sink_id and c.key not in named]
            if target.blocking_pre_commits:
                lost = [c for c in held if c.epoch < self.epoch]
            else:
                lost = [c for c in held if c.batch_id in finished]  # garbage of done batches
            for batch_id in sorted({c.batch_id for c in lost}):
                part = [c for c in lost if c.batch_id == batch_id]
                target.abort_batch(batch_id, part)
                report.aborted_leftovers.extend(c.name for c in part)
        self._prune(completed=completed)
        return report

    def _decided(self, batch_ids: set[int]) -> dict[str, dict[int, set[int]] | None]:
        """Per target, which runs' entries of ``batch_ids`` are its decisions (None: all)."""
        if not batch_ids:
            return {}
        return {t.sink_id: t.decided(batch_ids) for t in self.sink.targets()}

    def _commit(self, batch_id: int, decided: dict[str, dict[int, set[int]] | None], early: bool = False,
                names: list[str] | None = None) -> tuple[set[tuple[str, str]], bool]:
        """Commit ``batch_id`` on every target from its decisions (its entries among the journal
        listing ``names``); with ``early`` (the batch is decided but not complete) only where
        pre-commits block a replay. Returns the keys of what the decisions name (which recovery
        must never abort), and whether it committed."""
        entries = self.journal.read_all(batch_id, names)
        named: set[tuple[str, str]] = set()
        committed = False
        for index, target in enumerate(self.sink.targets()):
            epochs = decided.get(target.sink_id)
            valid = {e: [c for c in cs if c.sink_id == target.sink_id] for e, cs in entries.items()
                     if epochs is None or e in epochs.get(batch_id, set())}
            named |= {c.key for cs in valid.values() for c in cs}
            if not valid:
                if not early and entries:
                    raise CommitError(f"sink {target.sink_id} batch {batch_id}: Spark completed the batch, but no "
                                      f"journal entry of it is a decision (entries of epochs {sorted(entries)})")
                continue
            if early and not target.blocking_pre_commits:
                continue  # kept until the batch completes
            # Pre-commits that block a replay: every decision's (at most one holds anything open
            # per partition). Staged files: the newest entry's (an older one's files are the same
            # rows, written before the run that replayed the batch).
            committables = _unique([c for cs in valid.values() for c in cs]) if target.blocking_pre_commits \
                else valid[max(valid)]
            if index:
                crash_point("mid_commit", batch_id)
            crash_point("before_notify", batch_id)
            target.commit_batch(batch_id, committables)  # staged files: with whatever else was staged for it
            committed = True
        return named, committed

    def _abort(self, batch_id: int, committables: Sequence[Committable]) -> None:
        for target in self.sink.targets():
            part = [c for c in committables if c.sink_id == target.sink_id]
            if part:
                target.abort_batch(batch_id, part)

    def _leftovers(self, up_to: int | None = None, blocking_only: bool = False) -> list[Committable]:
        """What every target (with ``blocking_only``, every target whose pre-commits block a
        replay) holds open (prepared transactions, staged files), of batches up to ``up_to``
        (all if None)."""
        found = [c for t in self.sink.targets() if t.blocking_pre_commits for c in t.leftovers()] if blocking_only \
            else self.sink.leftovers()
        return found if up_to is None else [c for c in found if c.batch_id <= up_to]

    def _prune(self, names: list[str] | None = None, completed: set[int] | None = None) -> None:
        """Forget finished batches older than the oldest commit Spark still keeps (its
        ``minBatchesToRetain``), in the journal and in the sink: no recovery can need them. The
        sink forgets only below every batch the journal still holds unfinished. ``names``: a
        journal listing the caller took earlier in its step; a batch marked done since is then
        pruned at the next step (pruning less is always safe). ``completed``: Spark's commit log
        as the caller read it this step."""
        completed = self.spark_log.completed() if completed is None else completed
        if not completed:
            return
        journaled, done = self.journal.entries(names)
        oldest = min(completed)
        forgotten = sorted(b for b in done if b < oldest)
        for batch_id in forgotten:
            self.journal.delete(batch_id, names)
        if forgotten:
            self.journal.sweep(oldest, names)
            self.sink.forget(min([oldest, *(journaled - done)]))


def _unique(committables: Sequence[Committable]) -> list[Committable]:
    seen: dict[tuple[str, str], Committable] = {}
    for c in committables:
        seen.setdefault(c.key, c)
    return list(seen.values())


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

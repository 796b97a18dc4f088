"""The engine's decisions, on a checkpoint folder laid out as Spark lays it out and an in-memory
two-phase-commit sink with an epoch register and decisions (a fake is fine for pure logic; the
real proof is the simulation in tests/sim, and tests/eos on the real services)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from oncekit.core.bases import TwoPhaseCommitSink
from oncekit.core.engine import CheckpointEngine
from oncekit.core.errors import ConfigError, FencedError
from oncekit.core.journal import Journal
from oncekit.core.protocol import CommitOutcome, Committable, DeliveryGuarantee, TaskInfo


@dataclass
class Server:
    """What the target keeps, shared by every sink object of the test (every run's)."""

    epoch: int = 0
    prepared: dict[str, Committable] = field(default_factory=dict)
    committed: list[str] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    decisions: dict[tuple[int, int], str] = field(default_factory=dict)
    forgotten: list[int] = field(default_factory=list)


class MemorySink(TwoPhaseCommitSink[TaskInfo]):
    sink_id = "memory"
    guarantee = DeliveryGuarantee.EXACTLY_ONCE

    def __init__(self, server: Server | None = None) -> None:
        self.server = server or Server()

    def take_epoch(self, floor: int) -> int:
        self.server.epoch = max(self.server.epoch, floor) + 1
        return self.server.epoch

    def begin_transaction(self, task: TaskInfo) -> TaskInfo:
        return task

    def write(self, transaction: TaskInfo, batch: Any) -> None:
        pass

    def pre_commit(self, transaction: TaskInfo) -> Committable:
        t = transaction
        committable = Committable(t.sink_id, t.batch_id, t.partition_id, t.attempt, 1, transaction_id=t.transaction_id,
                                  epoch=t.epoch)
        self.server.prepared[t.transaction_id] = committable
        return committable

    def abort_open(self, transaction: TaskInfo) -> None:
        pass

    def commit(self, committable: Committable) -> CommitOutcome:
        if self.server.prepared.pop(committable.name, None) is None:
            assert committable.name not in self.server.aborted, f"{committable.name} was aborted: output lost"
            return CommitOutcome.ALREADY_COMMITTED
        self.server.committed.append(committable.name)
        return CommitOutcome.COMMITTED

    def abort(self, committable: Committable) -> CommitOutcome:
        if self.server.prepared.pop(committable.name, None) is None:
            return CommitOutcome.ALREADY_ABORTED
        self.server.aborted.append(committable.name)
        return CommitOutcome.ABORTED

    def leftovers(self, batch_ids: Iterable[int] | None = None) -> list[Committable]:
        wanted = None if batch_ids is None else set(batch_ids)
        return [c for c in self.server.prepared.values() if wanted is None or c.batch_id in wanted]

    def decide(self, batch_id: int, committables: Sequence[Committable]) -> None:
        if self.server.epoch > self.epoch:
            raise FencedError(f"sink memory batch {batch_id}: superseded")
        self.server.decisions.setdefault((batch_id, self.epoch), "decided")

    def decided(self, batch_ids: Iterable[int]) -> dict[int, set[int]]:
        return {b: {e for (batch, e), verdict in self.server.decisions.items() if batch == b and verdict == "decided"}
                for b in batch_ids}

    def veto(self, batch_id: int) -> bool:
        return self.server.decisions.setdefault((batch_id, self.epoch), "vetoed") == "vetoed"

    def forget(self, before_batch: int) -> None:
        self.server.forgotten.append(before_batch)


def spark_logged(checkpoint: Path, folder: str, *batch_ids: int) -> None:
    (checkpoint / folder).mkdir(parents=True, exist_ok=True)
    for batch_id in batch_ids:
        (checkpoint / folder / str(batch_id)).write_text("v1")


def prepare(engine: CheckpointEngine, batch_id: int, partition: int, attempt: int = 0) -> Committable:
    (committable,) = engine.write_task(TaskInfo("memory", batch_id, partition, attempt, engine.epoch), iter(()))
    return committable


def started(tmp_path: Path, server: Server, token: str) -> CheckpointEngine:
    engine = CheckpointEngine(MemorySink(server), str(tmp_path))
    engine.start_run(token)
    return engine


@pytest.fixture
def server() -> Server:
    return Server()


@pytest.fixture
def engine(tmp_path: Path, server: Server) -> CheckpointEngine:
    return started(tmp_path, server, "run-1")


def test_complete_commits_only_batches_in_sparks_commit_log(engine: CheckpointEngine, server: Server, tmp_path: Path) -> None:
    engine.checkpoint(0, [prepare(engine, 0, 0), prepare(engine, 0, 1)])
    engine.checkpoint(1, [prepare(engine, 1, 0)])
    spark_logged(tmp_path, "commits", 0)
    assert engine.complete(5) == [0]
    assert server.committed == ["oncekit:memory:0:0:0:e1", "oncekit:memory:0:1:0:e1"]
    assert engine.complete(5) == []  # a repeated notification commits nothing twice


def test_notification_for_later_batch_completes_skipped_ones(engine: CheckpointEngine, tmp_path: Path) -> None:
    for batch_id in (0, 1, 2):
        engine.checkpoint(batch_id, [prepare(engine, batch_id, 0)])
    spark_logged(tmp_path, "commits", 0, 1, 2)
    assert engine.complete(2) == [0, 1, 2]


def test_recover_commits_every_decision_and_aborts_what_no_decision_names(
        engine: CheckpointEngine, server: Server, tmp_path: Path) -> None:
    """Batch 0 completed, batch 1 decided but never logged by Spark (its replay will find it
    committed), batch 2's task prepared and its driver commit never came (undecided), and a lost
    attempt of batch 0: the next run commits both decisions and aborts the other two."""
    engine.checkpoint(0, [prepare(engine, 0, 0)])
    engine.checkpoint(1, [prepare(engine, 1, 0)])
    orphan = prepare(engine, 0, 1, attempt=7)  # a failed attempt of batch 0 that prepared after the driver's sweeps
    undecided = prepare(engine, 2, 0)
    spark_logged(tmp_path, "offsets", 0, 1, 2)
    spark_logged(tmp_path, "commits", 0)

    report = CheckpointEngine(MemorySink(server), str(tmp_path)).start_run("run-2")

    assert report.committed_batches == [0, 1] and sorted(report.aborted_leftovers) == sorted(
        [orphan.transaction_id, undecided.transaction_id])
    assert server.committed == ["oncekit:memory:0:0:0:e1", "oncekit:memory:1:0:0:e1"]
    assert sorted(server.aborted) == sorted([orphan.transaction_id, undecided.transaction_id])
    assert server.prepared == {}
    assert Journal(str(tmp_path), "memory").entries() == ({0, 1}, {0})


def test_a_newer_runs_recovery_never_touches_what_an_older_run_decides_after_it(
        engine: CheckpointEngine, server: Server, tmp_path: Path) -> None:
    """The older run's decision after the newer run took its epoch is refused, so what the newer
    run aborted was never decided by anyone."""
    pending = prepare(engine, 0, 0)
    newer = started(tmp_path, server, "run-2")
    assert server.aborted == [pending.transaction_id]
    with pytest.raises(FencedError):
        engine.checkpoint(0, [pending])
    assert Journal(str(tmp_path), "memory").run() == "run-2"
    assert newer.epoch == 2


def test_driver_commit_aborts_lost_attempts_of_its_batch(engine: CheckpointEngine, server: Server) -> None:
    lost = prepare(engine, 0, 0, attempt=1)
    kept = prepare(engine, 0, 0, attempt=2)
    engine.checkpoint(0, [kept])
    assert server.aborted == [lost.transaction_id]
    assert list(server.prepared) == [kept.transaction_id]


def test_driver_commit_aborts_strays_of_batches_it_decided_but_not_what_their_decision_names(
        engine: CheckpointEngine, server: Server) -> None:
    """A killed task on a slow executor can prepare after its batch's sweep: the next driver
    commit aborts it, and leaves what a decided, not yet committed batch holds. What a batch this
    run never decided holds is left to its stop or the next run."""
    pending = prepare(engine, 0, 0)
    engine.checkpoint(0, [pending], notified=True)  # batch 0: the listener's to commit, not yet
    stray = prepare(engine, 0, 1, attempt=9)
    undecided = prepare(engine, 1, 1, attempt=3)  # batch 1 never reached its driver commit
    engine.checkpoint(2, [prepare(engine, 2, 0)], notified=True)
    assert server.aborted == [stray.transaction_id]
    assert pending.transaction_id in server.prepared and undecided.transaction_id in server.prepared


def test_a_stopped_run_commits_what_it_decided_and_aborts_the_rest(engine: CheckpointEngine, server: Server) -> None:
    decided = prepare(engine, 0, 0)
    engine.checkpoint(0, [decided], notified=True)
    in_flight = prepare(engine, 1, 0)
    assert engine.abort_unfinished() == [in_flight.transaction_id]
    assert server.committed == [decided.transaction_id] and server.prepared == {}


def test_a_batch_spark_gave_up_is_closed_to_its_runs_decision(engine: CheckpointEngine, server: Server) -> None:
    """Spark's abort of a batch vetoes the run's decision of it first: a driver commit of the
    same batch that comes late (a paused Python worker) is refused, so nothing it names was
    aborted under a decision."""
    held = prepare(engine, 3, 0)
    engine.abort(3, [held])
    assert server.aborted == [held.transaction_id] and server.decisions[(3, 1)] == "vetoed"
    assert engine.sink.veto(3) and not engine.sink.decided([3])[3]


def test_driver_commit_with_a_listener_leaves_the_previous_batch_to_it(
        engine: CheckpointEngine, server: Server, tmp_path: Path) -> None:
    for batch_id in (0, 1):
        engine.checkpoint(batch_id, [prepare(engine, batch_id, 0)], notified=True)
        spark_logged(tmp_path, "commits", batch_id)
    engine.checkpoint(2, [prepare(engine, 2, 0)], notified=True)
    assert server.committed == ["oncekit:memory:0:0:0:e1"]  # batch 1: the listener's to commit
    spark_logged(tmp_path, "commits", 2)
    engine.checkpoint(3, [prepare(engine, 3, 0)])  # no listener: the catch-up reaches the previous batch
    assert server.committed == ["oncekit:memory:0:0:0:e1", "oncekit:memory:1:0:0:e1", "oncekit:memory:2:0:0:e1"]


def test_driver_commit_prunes_what_spark_no_longer_keeps(engine: CheckpointEngine, server: Server, tmp_path: Path) -> None:
    """A run recovers once, at its start: the driver commits keep the journal bounded."""
    for batch_id in (0, 1, 2):
        engine.checkpoint(batch_id, [prepare(engine, batch_id, 0)])
        spark_logged(tmp_path, "commits", batch_id)
    (tmp_path / "commits" / "0").unlink()  # Spark deleted its oldest commit file
    engine.checkpoint(3, [prepare(engine, 3, 0)])
    assert Journal(str(tmp_path), "memory").entries() == ({1, 2, 3}, {1, 2})
    assert server.forgotten == [1]


def fake_config(sink: MemorySink) -> Any:
    return SimpleNamespace(sink_id="memory", format_name="oncekit-memory", build=lambda checkpoint: sink)


def test_only_the_first_stream_writer_of_a_query_run_recovers(server: Server, tmp_path: Path) -> None:
    from oncekit.core.run import QueryRun, open_run

    sink = MemorySink(server)
    config = fake_config(sink)
    sink.preflight = lambda resumed=False: None  # type: ignore[method-assign]

    def writer(token: str, listener: bool = True) -> CheckpointEngine:
        return open_run(config, str(tmp_path), QueryRun(token, listener=listener))[0]

    def journaled_and_completed(engine: CheckpointEngine, batch_id: int) -> None:
        engine.checkpoint(batch_id, [prepare(engine, batch_id, 0)], notified=True)
        spark_logged(tmp_path, "commits", batch_id)

    first = writer("run-1")
    journaled_and_completed(first, 0)
    assert server.committed == []
    journaled_and_completed(writer("run-1"), 1)  # later in the run: no recovery
    assert server.committed == []
    second = writer("run-2")  # the query started again: its recovery commits what completed
    assert server.committed == ["oncekit:memory:0:0:0:e1", "oncekit:memory:1:0:0:e1"]
    journaled_and_completed(second, 2)
    writer("run-2", listener=False)
    assert server.committed[-1] == "oncekit:memory:2:0:0:e2"  # no listener: the writer notifies
    with pytest.raises(FencedError, match="query run run-1 \\(epoch 1\\) was superseded by epoch 2"):
        writer("run-1")
    assert QueryRun.from_options({"OnceKit.Run": "r", "oncekit.listener": "true"}) == QueryRun("r", True)


def test_recover_prunes_finished_batches_spark_no_longer_keeps(engine: CheckpointEngine, server: Server, tmp_path: Path) -> None:
    for batch_id in (0, 1, 2):
        engine.checkpoint(batch_id, [prepare(engine, batch_id, 0)])
    spark_logged(tmp_path, "commits", 0, 1, 2)
    engine.complete()
    for batch_id in (0, 1):  # Spark deleted its old commit files
        (tmp_path / "commits" / str(batch_id)).unlink()
    (tmp_path / "oncekit" / "memory" / "journal" / ".1.json.0a1b.tmp").write_text("")  # a killed writer's
    engine.recover()
    assert Journal(str(tmp_path), "memory").entries() == ({2}, {2})
    assert sorted(p.name for p in (tmp_path / "oncekit" / "memory" / "journal").iterdir()) == ["2.done", "2.e1.json", "runs"]
    assert server.forgotten == [2]  # marker rows of batches 0 and 1 may go
    engine.recover()
    assert server.forgotten == [2]  # nothing newly pruned, nothing to ask the target


def test_recover_forgets_in_the_sink_only_below_unfinished_batches(engine: CheckpointEngine, server: Server,
                                                                    tmp_path: Path) -> None:
    for batch_id in (0, 1, 2, 3):
        engine.checkpoint(batch_id, [prepare(engine, batch_id, 0)])
    spark_logged(tmp_path, "offsets", 0, 1, 2, 3)
    spark_logged(tmp_path, "commits", 0)
    engine.complete(0)
    journal = Journal(str(tmp_path), "memory")
    journal.mark_done(2)  # done, while batch 1 is journaled and not (a test's contrivance)
    (tmp_path / "commits" / "0").unlink()
    spark_logged(tmp_path, "commits", 3)
    engine._prune()
    assert server.forgotten == [1]


def test_staged_files_discard_removes_spent_batch_folders(tmp_path: Path) -> None:
    import pyarrow as pa

    from oncekit.core.staging import StagedFiles

    staged = StagedFiles(str(tmp_path), "wal")
    rows = pa.record_batch({"id": [1, 2]})
    kept = [staged.stage(TaskInfo("wal", batch, 0, 0), iter([rows])) for batch in (0, 1)]
    folder = tmp_path / "oncekit" / "wal" / "staged"
    (folder / "1" / ".0-9.arrow.0a1b.tmp").write_text("")  # a killed task's half-written file
    staged.discard([c for c in kept if c is not None])
    assert list(folder.iterdir()) == []


def test_journal_survives_as_json_and_rewrites_atomically(tmp_path: Path) -> None:
    journal = Journal(str(tmp_path), "s")
    first = [Committable("s", 3, 0, 0, 5, transaction_id="t0")]
    journal.write(3, first)
    journal.write(3, [*first, Committable("s", 3, 1, 0, 6, transaction_id="t1")])
    assert [c.transaction_id for c in journal.read(3)] == ["t0", "t1"]
    assert not [p for p in (tmp_path / "oncekit" / "s" / "journal").iterdir() if p.name.endswith(".tmp")]


def test_engine_imports_without_spark() -> None:
    import subprocess
    import sys

    program = ("import sys, oncekit.core.engine, oncekit.core.run, oncekit.core.staging, oncekit.sinks.postgres, "
               "oncekit.sinks.kafka; print('pyspark' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_recover_commits_a_journaled_batch_whose_commit_file_spark_purged(
        engine: CheckpointEngine, server: Server, tmp_path: Path) -> None:
    """Spark keeps ``minBatchesToRetain`` commit files: a batch whose notification kept failing
    until its file was purged is still complete (a later batch's file says so), never aborted."""
    late = prepare(engine, 3, 0)
    engine.checkpoint(3, [late])
    spark_logged(tmp_path, "offsets", 5, 6)
    spark_logged(tmp_path, "commits", 5)  # 3 and 4 purged
    report = engine.recover()
    assert report.committed_batches == [3] and report.aborted_leftovers == []
    assert server.committed == [late.transaction_id]


def test_a_query_started_by_another_version_of_the_kit_is_refused_by_the_writer(server: Server, tmp_path: Path) -> None:
    """A Spark Connect client's kit and the server's must agree on the journal and the markers."""
    from oncekit.core.run import QueryRun, open_run

    sink = MemorySink(server)
    sink.preflight = lambda resumed=False: None  # type: ignore[method-assign]
    config = fake_config(sink)
    with pytest.raises(ConfigError, match=r"sink memory: the query was started with oncekit 0\.0\.9.*install oncekit==0\.0\.9"):
        open_run(config, str(tmp_path), QueryRun("run-1", version="0.0.9"))
    assert Journal(str(tmp_path), "memory").run() is None  # refused before the run took its epoch
    open_run(config, str(tmp_path), QueryRun.started(listener=True))


def test_journal_keeps_each_runs_entry_reads_the_newest_and_never_reopens_a_done_batch(tmp_path: Path) -> None:
    """A run paused past its lease that journals late writes its own file, which readers pass
    over for a newer run's (issue 33)."""
    from oncekit.core.errors import CommitError

    journal = Journal(str(tmp_path), "s")
    journal.write(4, [Committable("s", 4, 0, 0, 5, transaction_id="newer", epoch=3)], epoch=3)
    journal.write(4, [Committable("s", 4, 0, 7, 5, transaction_id="older", epoch=2)], epoch=2)  # the late one
    assert [c.transaction_id for c in journal.read(4)] == ["newer"] and set(journal.read_all(4)) == {2, 3}
    assert journal.entries() == ({4}, set())
    written, done = Journal.stamps({"4.e2.json": 1.0, "4.e3.json": 2.0, "5.json": 3.0, "5.done": 4.0})
    assert written == {4: 2.0, 5: 3.0} and done == {5: 4.0}
    journal.mark_done(4)
    with pytest.raises(CommitError, match="sink s batch 4: already committed"):
        journal.write(4, [Committable("s", 4, 0, 0, 5, transaction_id="again", epoch=4)], epoch=4)
    journal.write(4, [], epoch=4)  # a replay its sink found committed: nothing to reopen
    assert [c.transaction_id for c in journal.read(4)] == ["newer"] and journal.entries() == ({4}, {4})
    journal.delete(4)
    assert journal.entries() == (set(), set())


def test_journal_records_each_runs_epoch_and_forgets_all_but_the_newest(tmp_path: Path) -> None:
    from oncekit.core.journal import RUNS_KEPT

    journal = Journal(str(tmp_path), "s")
    assert journal.latest_epoch() == 0 and journal.epoch_of("a") is None and journal.run() is None
    for epoch in range(1, RUNS_KEPT + 3):
        journal.record_epoch(f"run{epoch}", epoch)
    assert journal.latest_epoch() == RUNS_KEPT + 2 and journal.epoch_of("run5") == 5
    assert journal.epoch_of("run1") is None and len(journal.runs()) == RUNS_KEPT
    assert journal.run() == f"run{RUNS_KEPT + 2}"


def test_names_carry_the_runs_epoch_and_old_names_parse_as_epoch_0() -> None:
    from oncekit.core.names import StagedFile, TransactionId

    assert str(TaskInfo("s", 1, 2, 3, epoch=4).transaction_id) == "oncekit:s:1:2:3:e4"
    assert TransactionId.parse("oncekit:s:1:2:3:e4") == TransactionId("s", 1, 2, 3, 4)
    assert TransactionId.parse("oncekit:s:1:2:3") == TransactionId("s", 1, 2, 3, 0)
    assert TaskInfo("s", 1, 2, 3, epoch=4).staged_file == "1/2-3-e4.arrow"
    assert StagedFile.parse("1/2-3-e4.arrow") == StagedFile(1, 2, 3, 4)
    assert StagedFile.parse("1/2-3.arrow") == StagedFile(1, 2, 3, 0)


def test_a_writer_of_a_query_started_without_start_query_refuses_it_by_name(tmp_path: Path) -> None:
    from oncekit.core.run import QueryRun, open_run

    config: Any = SimpleNamespace(sink_id="memory", format_name="oncekit-postgres")
    with pytest.raises(ConfigError, match=r"sink memory: .*format\('oncekit-postgres'\).*oncekit\.start_query"):
        open_run(config, str(tmp_path), QueryRun.from_options({}))


def test_an_engine_for_no_run_refuses_to_act(tmp_path: Path) -> None:
    engine = CheckpointEngine(MemorySink(), str(tmp_path))
    with pytest.raises(ConfigError, match="acts for no query run"):
        engine.checkpoint(0, [])

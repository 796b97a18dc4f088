"""The engine's decisions, on a checkpoint folder laid out as Spark lays it out and an in-memory
two-phase-commit sink (a fake is fine for pure logic; the real proof is in tests/eos)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

from oncekit.core.protocol import CommitOutcome, Committable, DeliveryGuarantee, TaskInfo, TwoPhaseCommitSink
from oncekit.core.engine import CheckpointEngine
from oncekit.core.journal import Journal


class MemorySink(TwoPhaseCommitSink[TaskInfo]):
    sink_id = "memory"
    guarantee = DeliveryGuarantee.EXACTLY_ONCE

    def __init__(self) -> None:
        self.prepared: dict[str, Committable] = {}
        self.committed: list[str] = []
        self.aborted: list[str] = []

    def begin_transaction(self, task: TaskInfo) -> TaskInfo:
        return task

    def write(self, transaction: TaskInfo, batch: Any) -> None:
        pass

    def pre_commit(self, transaction: TaskInfo) -> Committable:
        t = transaction
        committable = Committable(t.sink_id, t.batch_id, t.partition_id, t.attempt, 1, transaction_id=t.transaction_id)
        self.prepared[t.transaction_id] = committable
        return committable

    def abort_open(self, transaction: TaskInfo) -> None:
        pass

    def commit(self, committable: Committable) -> CommitOutcome:
        if self.prepared.pop(committable.transaction_id, None) is None:
            return CommitOutcome.ALREADY_COMMITTED
        self.committed.append(committable.transaction_id)
        return CommitOutcome.COMMITTED

    def abort(self, committable: Committable) -> CommitOutcome:
        if self.prepared.pop(committable.transaction_id, None) is None:
            return CommitOutcome.ALREADY_ABORTED
        self.aborted.append(committable.transaction_id)
        return CommitOutcome.ABORTED

    def leftovers(self, batch_ids: Iterable[int] | None = None) -> list[Committable]:
        return [c for c in self.prepared.values() if batch_ids is None or c.batch_id in set(batch_ids)]


def spark_logged(checkpoint: Path, folder: str, *batch_ids: int) -> None:
    (checkpoint / folder).mkdir(parents=True, exist_ok=True)
    for batch_id in batch_ids:
        (checkpoint / folder / str(batch_id)).write_text("v1")


def prepare(engine: CheckpointEngine, batch_id: int, partition: int, attempt: int = 0) -> Committable:
    (committable,) = engine.write_task(TaskInfo("memory", batch_id, partition, attempt), iter(()))
    return committable


@pytest.fixture
def engine(tmp_path: Path) -> CheckpointEngine:
    return CheckpointEngine(MemorySink(), str(tmp_path))


def sink_of(engine: CheckpointEngine) -> MemorySink:
    assert isinstance(engine.sink, MemorySink)
    return engine.sink


def test_complete_commits_only_batches_in_sparks_commit_log(engine: CheckpointEngine, tmp_path: Path) -> None:
    engine.checkpoint(0, [prepare(engine, 0, 0), prepare(engine, 0, 1)])
    engine.checkpoint(1, [prepare(engine, 1, 0)])
    spark_logged(tmp_path, "commits", 0)
    assert engine.complete(5) == [0]
    assert sink_of(engine).committed == ["oncekit:memory:0:0:0", "oncekit:memory:0:1:0"]
    assert engine.complete(5) == []  # a repeated notification commits nothing twice


def test_notification_for_later_batch_completes_skipped_ones(engine: CheckpointEngine, tmp_path: Path) -> None:
    for batch_id in (0, 1, 2):
        engine.checkpoint(batch_id, [prepare(engine, batch_id, 0)])
    spark_logged(tmp_path, "commits", 0, 1, 2)
    assert engine.complete(2) == [0, 1, 2]


def test_recover_commits_completed_aborts_incomplete_and_orphans(engine: CheckpointEngine, tmp_path: Path) -> None:
    engine.checkpoint(0, [prepare(engine, 0, 0)])
    orphan = prepare(engine, 0, 1, attempt=7)  # a failed attempt of batch 0 that prepared
    engine.checkpoint(1, [prepare(engine, 1, 0)])
    running = prepare(engine, 2, 0)             # batch 2 is running: its driver commit may come
    spark_logged(tmp_path, "offsets", 0, 1, 2)
    spark_logged(tmp_path, "commits", 0)

    report = engine.recover()

    assert report.committed_batches == [0] and report.aborted_batches == [1]
    assert report.aborted_leftovers == [orphan.transaction_id]
    assert list(sink_of(engine).prepared) == [running.transaction_id]
    assert Journal(str(tmp_path), "memory").entries() == ({0}, {0})


def test_driver_commit_aborts_lost_attempts_of_its_batch(engine: CheckpointEngine) -> None:
    lost = prepare(engine, 0, 0, attempt=1)
    kept = prepare(engine, 0, 0, attempt=2)
    engine.checkpoint(0, [kept])
    assert sink_of(engine).aborted == [lost.transaction_id]
    assert list(sink_of(engine).prepared) == [kept.transaction_id]


def test_recover_prunes_finished_batches_spark_no_longer_keeps(engine: CheckpointEngine, tmp_path: Path) -> None:
    for batch_id in (0, 1, 2):
        engine.checkpoint(batch_id, [prepare(engine, batch_id, 0)])
    spark_logged(tmp_path, "commits", 0, 1, 2)
    engine.complete()
    for batch_id in (0, 1):  # Spark deleted its old commit files
        (tmp_path / "commits" / str(batch_id)).unlink()
    engine.recover()
    assert Journal(str(tmp_path), "memory").entries() == ({2}, {2})


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

    program = ("import sys, oncekit.core.engine, oncekit.core.staging, oncekit.sinks.postgres, oncekit.sinks.kafka; "
               "print('pyspark' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"

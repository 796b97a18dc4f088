"""Recovery on a real PostgreSQL server, driven directly (no Spark): the engine reads a
checkpoint folder laid out as Spark lays it out, and prepared transactions are counted in
``pg_prepared_xacts`` after every step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pytest

from oncekit.core.errors import CommitError
from oncekit.core.protocol import Committable, TaskInfo
from oncekit.core.engine import CheckpointEngine
from oncekit.sinks.postgres import BadRecordError, postgres_sink

pytestmark = pytest.mark.services


def write(engine: CheckpointEngine, task: TaskInfo, batches: Any) -> Committable:
    """A two-phase-commit task's one committable (``write_task`` returns a list)."""
    (committable,) = engine.write_task(task, batches)
    return committable


def spark_logged(checkpoint: Path, *, planned: list[int], committed: list[int]) -> None:
    for folder, ids in (("offsets", planned), ("commits", committed)):
        (checkpoint / folder).mkdir(parents=True, exist_ok=True)
        for batch_id in ids:
            (checkpoint / folder / str(batch_id)).write_text("v1\n{}")


def rows(ids: list[int]) -> pa.RecordBatch:
    return pa.record_batch([pa.array(ids, pa.int32()), pa.array([str(i) for i in ids])], names=["id", "payload"])


@pytest.fixture
def engine(postgres_dsn: str, unique_name: str, tmp_path: Path) -> CheckpointEngine:
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {unique_name} (id int NOT NULL, payload text NOT NULL)")
    config = postgres_sink(postgres_dsn, unique_name, "two-phase-commit", columns=("id", "payload"))
    sink = config.build(str(tmp_path))
    sink.preflight()
    engine = CheckpointEngine(sink, str(tmp_path))
    engine.start_run("run-1")
    return engine


def prepared(dsn: str, sink_id: str) -> list[str]:
    with psycopg.connect(dsn) as conn:
        return sorted(r[0] for r in conn.execute("SELECT gid FROM pg_prepared_xacts WHERE gid LIKE %s", (f"oncekit:{sink_id}:%",)))


def ids_in(dsn: str, table: str) -> list[int]:
    with psycopg.connect(dsn) as conn:
        return sorted(r[0] for r in conn.execute(f"SELECT id FROM {table}"))


def test_recovery_commits_every_decided_batch_and_aborts_what_no_decision_names(
    engine: CheckpointEngine, postgres_dsn: str, unique_name: str, tmp_path: Path
) -> None:
    """Batch 0 decided and logged by Spark, batch 1 decided and not logged (the process died
    between the two), batch 2 prepared by its tasks and never decided: the next run commits both
    decisions (batch 1's replay will find it committed) and aborts batch 2's transaction."""
    sink_id = engine.sink.sink_id
    batch0 = [write(engine, TaskInfo(sink_id, 0, p, 0, epoch=engine.epoch), iter([rows([p])])) for p in (0, 1)]
    engine.checkpoint(0, [c for c in batch0 if c])
    batch1 = [write(engine, TaskInfo(sink_id, 1, p, 0, epoch=engine.epoch), iter([rows([10 + p])])) for p in (0, 1)]
    engine.checkpoint(1, [c for c in batch1 if c])
    write(engine, TaskInfo(sink_id, 2, 0, 0, epoch=engine.epoch), iter([rows([20])]))  # never decided
    assert len(prepared(postgres_dsn, sink_id)) == 5
    spark_logged(tmp_path, planned=[0, 1, 2], committed=[0])

    report = CheckpointEngine(engine.sink.__class__(engine.sink.config, str(tmp_path)), str(tmp_path)).start_run("run-2")

    assert report.committed_batches == [0, 1] and len(report.aborted_leftovers) == 1
    assert ids_in(postgres_dsn, unique_name) == [0, 1, 10, 11]
    assert prepared(postgres_dsn, sink_id) == []


def test_attempt_aborted_by_a_second_attempt_fails_the_checkpoint_before_the_journal(
    engine: CheckpointEngine, postgres_dsn: str, unique_name: str, tmp_path: Path
) -> None:
    """Two attempts of one partition at once (spark.speculation, or a stage retried while the
    old attempt still runs): the second aborts what the first prepared, and the first reports
    success all the same. Journaled, its committable could never commit and Spark would log the
    batch complete without its rows; the driver's commit fails instead, and the replay is
    exactly-once."""
    sink_id = engine.sink.sink_id
    spark_logged(tmp_path, planned=[0], committed=[])
    first = write(engine, TaskInfo(sink_id, 0, 0, 1, epoch=engine.epoch), iter([rows([1, 2])]))
    write(engine, TaskInfo(sink_id, 0, 0, 2, epoch=engine.epoch), iter([rows([1, 2])]))  # the second attempt, which Spark ignores
    with pytest.raises(CommitError, match=rf"batch 0: pre-committed {first.transaction_id} no longer held"):
        engine.checkpoint(0, [first])
    assert engine.journal.entries() == (set(), set())
    engine.abort(0, [first])  # Spark gives up on the batch; the restart replays it
    engine = CheckpointEngine(engine.sink.__class__(engine.sink.config, str(tmp_path)), str(tmp_path))  # type: ignore[attr-defined]
    engine.start_run("run-2")
    replay = write(engine, TaskInfo(sink_id, 0, 0, 3, epoch=engine.epoch), iter([rows([1, 2])]))
    engine.checkpoint(0, [replay])
    spark_logged(tmp_path, planned=[0], committed=[0])
    engine.complete()
    assert ids_in(postgres_dsn, unique_name) == [1, 2]
    assert prepared(postgres_dsn, sink_id) == []


def test_stray_prepared_by_hand_for_an_earlier_batch_is_gone_after_the_next_driver_commit(
    engine: CheckpointEngine, postgres_dsn: str, unique_name: str, tmp_path: Path
) -> None:
    """A killed task on a slow executor can PREPARE after its batch's sweep; it holds locks, a
    max_prepared_transactions slot and vacuum until someone aborts it: the next driver commit
    does, and leaves what the listener has yet to commit."""
    sink_id = engine.sink.sink_id
    for batch_id in range(4):
        engine.checkpoint(batch_id, [write(engine, TaskInfo(sink_id, batch_id, 0, batch_id, epoch=engine.epoch), iter([rows([batch_id])]))],
                          notified=True)
        spark_logged(tmp_path, planned=list(range(batch_id + 1)), committed=list(range(batch_id + 1)))
    stray = f"oncekit:{sink_id}:1:0:999"
    with psycopg.connect(postgres_dsn) as conn:
        conn.execute(f"INSERT INTO {unique_name} VALUES (99, 'stray')")
        conn.execute(f"PREPARE TRANSACTION '{stray}'")
    assert stray in prepared(postgres_dsn, sink_id)
    engine.checkpoint(4, [write(engine, TaskInfo(sink_id, 4, 0, 4, epoch=engine.epoch), iter([rows([4])]))], notified=True)
    held = prepared(postgres_dsn, sink_id)
    assert stray not in held and len(held) == 2  # batches 3 and 4: the listener's to commit
    spark_logged(tmp_path, planned=list(range(5)), committed=list(range(5)))
    engine.complete()
    assert ids_in(postgres_dsn, unique_name) == [0, 1, 2, 3, 4]


def test_commit_is_idempotent_and_vanished_id_without_marker_is_error(
    engine: CheckpointEngine, postgres_dsn: str
) -> None:
    sink = engine.sink
    sink_id = sink.sink_id
    committable = write(engine, TaskInfo(sink_id, 0, 0, 0, epoch=engine.epoch), iter([rows([1])]))
    assert committable is not None
    assert sink.commit(committable).value == "committed"        # type: ignore[attr-defined]
    assert sink.commit(committable).value == "already committed"  # type: ignore[attr-defined]
    rolled_back = write(engine, TaskInfo(sink_id, 1, 0, 0, epoch=engine.epoch), iter([rows([2])]))
    assert rolled_back is not None
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(f"ROLLBACK PREPARED '{rolled_back.transaction_id}'")
    with pytest.raises(CommitError, match=rolled_back.transaction_id):
        sink.commit(rolled_back)  # type: ignore[attr-defined]


def test_bad_row_fails_batch_naming_sink_batch_and_column(engine: CheckpointEngine, postgres_dsn: str, unique_name: str) -> None:
    bad = pa.record_batch([pa.array([1, 2, 3], pa.int32()), pa.array(["a", None, "c"])], names=["id", "payload"])
    with pytest.raises(BadRecordError, match=rf"sink {engine.sink.sink_id} batch 4 partition 0: row 1 of the partition, column payload"):
        engine.write_task(TaskInfo(engine.sink.sink_id, 4, 0, 0, epoch=engine.epoch), iter([bad]))
    assert prepared(postgres_dsn, engine.sink.sink_id) == []
    assert ids_in(postgres_dsn, unique_name) == []


def test_bad_row_goes_to_dead_letter_table_rest_commits(postgres_dsn: str, unique_name: str, tmp_path: Path) -> None:
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {unique_name} (id int NOT NULL, payload text NOT NULL)")
    config = postgres_sink(postgres_dsn, unique_name, "two-phase-commit", columns=("id", "payload"),
                           dead_letter_table=f"{unique_name}_dead")
    engine = CheckpointEngine(config.build(str(tmp_path)), str(tmp_path))
    engine.sink.preflight()
    engine.start_run("run-1")
    bad = pa.record_batch([pa.array([1, 2, 3], pa.int32()), pa.array(["a", None, "c"])], names=["id", "payload"])
    committable = write(engine, TaskInfo(config.sink_id, 0, 0, 0, epoch=engine.epoch), iter([bad]))
    engine.checkpoint(0, [committable] if committable else [])
    spark_logged(tmp_path, planned=[0], committed=[0])
    engine.complete(0)
    assert ids_in(postgres_dsn, unique_name) == [1, 3]
    with psycopg.connect(postgres_dsn) as conn:
        dead = conn.execute(f"SELECT batch_id, row_number, record->>'id', error FROM {unique_name}_dead").fetchall()
    assert len(dead) == 1 and dead[0][:3] == (0, 1, "2") and "null value" in dead[0][3]


def test_preflight_names_missing_table_and_columns(postgres_dsn: str, unique_name: str, tmp_path: Path) -> None:
    from oncekit.core.errors import ConfigError

    missing = postgres_sink(postgres_dsn, unique_name, "two-phase-commit", columns=("id",)).build(str(tmp_path))
    with pytest.raises(ConfigError, match=f"table {unique_name} does not exist"):
        missing.preflight()
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {unique_name} (id int)")
    wrong = postgres_sink(postgres_dsn, unique_name, "idempotent", columns=("id", "amount"), key_columns=("id",))
    with pytest.raises(ConfigError, match="no column.*amount"):
        wrong.build(str(tmp_path)).preflight()
    unkeyed = postgres_sink(postgres_dsn, unique_name, "idempotent", columns=("id",), key_columns=("id",))
    with pytest.raises(ConfigError, match="unique index"):
        unkeyed.build(str(tmp_path)).preflight()


def test_sink_config_repr_and_errors_hide_password(tmp_path: Path) -> None:
    config = postgres_sink("postgresql://u:s3cr3t@127.0.0.1:1/db", "t", "two-phase-commit")
    assert "s3cr3t" not in repr(config) and "s3cr3t" not in repr(config.build(str(tmp_path)))
    with pytest.raises(Exception) as failure:
        config.build(str(tmp_path)).preflight()
    assert "s3cr3t" not in str(failure.value)


def test_concurrent_commits_of_one_transaction_commit_it_once(engine: CheckpointEngine, postgres_dsn: str, unique_name: str) -> None:
    """The listener, the driver's recovery and tasks may commit the same checkpoint at once."""
    from concurrent.futures import ThreadPoolExecutor

    committable = write(engine, TaskInfo(engine.sink.sink_id, 0, 0, 0, epoch=engine.epoch), iter([rows([1, 2, 3])]))
    assert committable is not None
    with ThreadPoolExecutor(8) as pool:
        outcomes = [o.value for o in pool.map(lambda _: engine.sink.commit(committable), range(8))]  # type: ignore[attr-defined]
    assert outcomes.count("committed") == 1 and outcomes.count("already committed") == 7
    assert ids_in(postgres_dsn, unique_name) == [1, 2, 3]

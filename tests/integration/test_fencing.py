"""Two drivers on one checkpoint (issue 33), driven directly on a real PostgreSQL server (no
Spark): a driver paused past its lease acts once more when it wakes, and what it does must not
change what the run that took over wrote. Each run has its epoch; Spark's task attempt ids start
again at 0 in every application, so only the epoch tells the two runs' work apart."""

from __future__ import annotations

import collections
from pathlib import Path

import psycopg
import pytest

from oncekit.core.engine import CheckpointEngine
from oncekit.core.errors import FencedError, OncekitError
from oncekit.core.protocol import TaskInfo
from oncekit.sinks.postgres import postgres_sink
from tests.integration.test_postgres_recovery import rows, spark_logged

pytestmark = pytest.mark.services

PROTOCOLS = ("two-phase-commit", "write-ahead-log")


def engines(dsn: str, table: str, checkpoint: Path, protocol: str) -> tuple[CheckpointEngine, CheckpointEngine]:
    """The engines of the old run (epoch 1) and of the run that took over (epoch 2)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE IF NOT EXISTS {table} (id int NOT NULL, payload text NOT NULL)")
    config = postgres_sink(dsn, table, protocol, columns=("id", "payload"))
    found = []
    for epoch in (1, 2):
        sink = config.build(str(checkpoint))
        sink.preflight()
        found.append(CheckpointEngine(sink, str(checkpoint), epoch))
    return found[0], found[1]


def table_ids(dsn: str, table: str) -> collections.Counter[int]:
    with psycopg.connect(dsn) as conn:
        return collections.Counter(r[0] for r in conn.execute(f"SELECT id FROM {table}"))


def prepared(dsn: str, table: str) -> list[str]:
    """The kit's prepared transactions of the sinks into ``table`` (other tests' are not this one's)."""
    with psycopg.connect(dsn) as conn:
        return [r[0] for r in conn.execute("SELECT gid FROM pg_prepared_xacts WHERE gid LIKE 'oncekit:%'")
                if table in r[0]]


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_postgres_an_older_runs_abort_leaves_the_newer_runs_batch_alone(
    postgres_dsn: str, unique_name: str, tmp_path: Path, protocol: str,
) -> None:
    """The old driver pre-committed batch 0 and was paused; a standby's run recovered (aborting
    the old run's work) and replayed batch 0; the old driver wakes inside Spark's abort of batch 0.
    Its abort must touch only its own run's work: the batch is then committed once."""
    old, new = engines(postgres_dsn, unique_name, tmp_path, protocol)
    sink_id = old.sink.sink_id
    spark_logged(tmp_path, planned=[0], committed=[])
    mine = old.write_task(TaskInfo(sink_id, 0, 0, 7, epoch=1), iter([rows([1, 2])]))

    new.recover()
    replayed = new.write_task(TaskInfo(sink_id, 0, 0, 0, epoch=2), iter([rows([1, 2])]))
    new.checkpoint(0, replayed)

    old.abort(0, mine)  # the old driver, resumed

    spark_logged(tmp_path, planned=[0], committed=[0])
    new.complete()
    assert table_ids(postgres_dsn, unique_name) == collections.Counter([1, 2])
    assert prepared(postgres_dsn, unique_name) == []


def test_postgres_two_phase_commit_a_batch_already_committed_is_never_committed_again(
    postgres_dsn: str, unique_name: str, tmp_path: Path,
) -> None:
    """The old driver completed batch 0 (journal, Spark's commit log, commit) while a second
    driver, started on the same checkpoint, replayed the same batch: the second run's replay must
    not reopen the batch, and nothing of it is committed a second time."""
    old, new = engines(postgres_dsn, unique_name, tmp_path, "two-phase-commit")
    sink_id = old.sink.sink_id
    spark_logged(tmp_path, planned=[0], committed=[])
    new.recover()  # the second driver started before batch 0 completed
    old.checkpoint(0, old.write_task(TaskInfo(sink_id, 0, 0, 7, epoch=1), iter([rows([1, 2])])))
    spark_logged(tmp_path, planned=[0], committed=[0])
    old.complete()
    assert table_ids(postgres_dsn, unique_name) == collections.Counter([1, 2])

    try:
        new.checkpoint(0, new.write_task(TaskInfo(sink_id, 0, 0, 0, epoch=2), iter([rows([1, 2])])))
    except OncekitError:
        pass  # refused: the batch is committed
    new.complete()

    assert table_ids(postgres_dsn, unique_name) == collections.Counter([1, 2])
    assert prepared(postgres_dsn, unique_name) == []


def started_runs(dsn: str, table: str, checkpoint: Path, protocol: str) -> tuple[CheckpointEngine, CheckpointEngine]:
    """Two runs that each took their epoch from the sink (:meth:`CheckpointEngine.start_run`):
    the old one first, then the one that took over."""
    old, new = engines(dsn, table, checkpoint, protocol)
    old.start_run("old")
    new.start_run("new")
    assert (old.epoch, new.epoch) == (1, 2)
    return old, new


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_postgres_an_older_run_is_refused_by_the_sink_once_a_newer_run_took_its_epoch(
    postgres_dsn: str, unique_name: str, tmp_path: Path, protocol: str,
) -> None:
    """Fencing at the target, not by timing: the old run's task pre-commit (two-phase commit) or
    the old run's send of a completed batch (write-ahead log), both after the newer run took
    the sink's epoch, are refused by PostgreSQL's row, with FencedError naming sink, batch and
    epochs; nothing of the old run is committed or left prepared."""
    old, new = started_runs(postgres_dsn, unique_name, tmp_path, protocol)
    sink_id = old.sink.sink_id
    spark_logged(tmp_path, planned=[0], committed=[])
    if protocol == "two-phase-commit":
        with pytest.raises(FencedError, match=rf"sink {sink_id} batch 0 partition 0: this run \(epoch 1\) was superseded by epoch 2"):
            old.write_task(TaskInfo(sink_id, 0, 0, 3, epoch=1), iter([rows([1, 2])]))
    else:
        staged = old.write_task(TaskInfo(sink_id, 0, 0, 3, epoch=1), iter([rows([1, 2])]))
        old.journal.write(0, staged, epoch=1)  # as the old driver's commit did before it was paused
        spark_logged(tmp_path, planned=[0], committed=[0])
        with pytest.raises(FencedError, match=rf"sink {sink_id} batch 0: this run \(epoch 1\) was superseded by epoch 2"):
            old.complete()
    assert table_ids(postgres_dsn, unique_name) == collections.Counter()
    assert prepared(postgres_dsn, unique_name) == []


def test_a_superseded_runs_recovery_and_journal_writes_are_refused(
    postgres_dsn: str, unique_name: str, tmp_path: Path,
) -> None:
    """The old run wakes up and recovers (its driver restarted its query) or journals a batch
    after the newer run prepared: refused with FencedError before it touches anything."""
    old, new = started_runs(postgres_dsn, unique_name, tmp_path, "two-phase-commit")
    sink_id = new.sink.sink_id
    spark_logged(tmp_path, planned=[0], committed=[])
    replayed = new.write_task(TaskInfo(sink_id, 0, 0, 0, epoch=2), iter([rows([5])]))
    with pytest.raises(FencedError, match=r"this run \(epoch 1\) was superseded"):
        old.recover()
    with pytest.raises(FencedError, match=r"batch 0: this run \(epoch 1\) was superseded by epoch 2"):
        old.checkpoint(0, [])
    new.checkpoint(0, replayed)
    spark_logged(tmp_path, planned=[0], committed=[0])
    new.complete()
    assert table_ids(postgres_dsn, unique_name) == collections.Counter([5])
    assert prepared(postgres_dsn, unique_name) == []


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_stopped_run_aborts_only_its_own_work_of_batches_spark_did_not_complete(
    postgres_dsn: str, unique_name: str, tmp_path: Path, protocol: str,
) -> None:
    """A query stopped in the middle of a batch (its tasks had pre-committed, its driver commit
    never came) leaves nothing prepared: the stop aborts its run's transactions of that batch,
    which the next start replays, and leaves a newer run's alone. Staged files hold nothing and
    wait until their batch is done (the replay's publish deletes them)."""
    old, new = started_runs(postgres_dsn, unique_name, tmp_path, protocol)
    sink_id = new.sink.sink_id
    spark_logged(tmp_path, planned=[0, 1], committed=[0])
    new.checkpoint(0, new.write_task(TaskInfo(sink_id, 0, 0, 1, epoch=2), iter([rows([1])])))
    new.complete()
    in_flight = new.write_task(TaskInfo(sink_id, 1, 0, 2, epoch=2), iter([rows([2])]))
    assert old.abort_unfinished() == []  # the old run's stop: nothing of its own
    blocking = protocol == "two-phase-commit"
    assert new.abort_unfinished() == ([c.name for c in in_flight] if blocking else [])
    assert [c.name for c in new.sink.leftovers()] == ([] if blocking else [c.name for c in in_flight])
    assert prepared(postgres_dsn, unique_name) == []
    assert table_ids(postgres_dsn, unique_name) == collections.Counter([1])


def test_a_failed_runs_sweep_aborts_what_its_killed_task_staged_after_a_newer_run_completed_the_batch(
    postgres_dsn: str, unique_name: str, tmp_path: Path,
) -> None:
    """The failed run's sweep of its stragglers (:func:`oncekit.core.spark.query.abort_stragglers`)
    comes while its restart may already run: a killed task of the failed batch can stage its
    file after the restarted run replayed, journaled and completed that batch. No journal entry
    names the file, and the sweep leaves it (the failed run decided nothing of the batch, and a
    staged file blocks nothing); the newer run's publish of the batch deletes it with the rest."""
    old, new = started_runs(postgres_dsn, unique_name, tmp_path, "write-ahead-log")
    sink_id = new.sink.sink_id
    spark_logged(tmp_path, planned=[0], committed=[0])
    new.checkpoint(0, new.write_task(TaskInfo(sink_id, 0, 0, 1, epoch=2), iter([rows([1])])))
    old.write_task(TaskInfo(sink_id, 0, 1, 9, epoch=1), iter([rows([2])]))  # the straggler
    assert old.abort_unfinished() == []
    new.complete()
    assert new.sink.leftovers() == []
    assert table_ids(postgres_dsn, unique_name) == collections.Counter([1])

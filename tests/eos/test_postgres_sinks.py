"""Exactly-once into PostgreSQL under crashes at every protocol step, on real Kafka, Postgres
and Spark. Each case crashes once at a named point, restarts from the same checkpoint, and
compares the table with the input as multisets."""

from __future__ import annotations

import threading
import time

from pathlib import Path
from typing import Any

import psycopg
import pytest

from oncekit.connectors import KafkaConfig
from oncekit.core.crash import POINTS, arm, fired
from oncekit.core.journal import Journal
from oncekit.core.names import TransactionId
from oncekit.core.spark.listener import CheckpointListener
from oncekit.core.spark.query import Trigger, start_query
from oncekit.sinks.postgres import postgres_sink
from oncekit.verify import compare
from tests.eos.pipeline import (COUNT, PER_BATCH, integers, prepared_after_the_sweep, prepared_transactions, produce_input,
                                run_available_now, table_ids, read_by, with_connectors)

pytestmark = [pytest.mark.services, pytest.mark.spark]


CASES = [
    *[("two-phase-commit", point) for point in POINTS],
    *[("write-ahead-log", point) for point in POINTS],
    # an idempotent sink has nothing to commit after the checkpoint, so no mid-commit
    *[("idempotent", point) for point in POINTS if point != "mid_commit"],
]


def create_table(dsn: str, name: str, keyed: bool) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {name} (id int {'PRIMARY KEY' if keyed else 'NOT NULL'}, payload text NOT NULL)")


def test_a_query_started_in_another_thread_than_the_sessions_runs_exactly_once(
    spark: Any, kafka: KafkaConfig, postgres_dsn: str, topic: str, unique_name: str, tmp_path: Path,
) -> None:
    """Spark looks a Python data source up in the active session of the calling thread, and only
    the thread that created the session has one: the kit's source and start_query must work from
    any thread (a job that supervises its queries from a thread, the demo that starts Spark in
    one while its services start)."""
    expected = produce_input(kafka, topic, COUNT)
    create_table(postgres_dsn, unique_name, keyed=False)
    sink = postgres_sink(postgres_dsn, unique_name, "two-phase-commit")
    failed: list[BaseException] = []

    def run() -> None:
        try:
            run_available_now(integers(spark, kafka, topic, PER_BATCH), sink, str(tmp_path / "checkpoint"))
        except BaseException as exc:
            failed.append(exc)

    thread = threading.Thread(target=run, name="not-the-session-thread")
    thread.start()
    thread.join(300)
    assert not thread.is_alive() and not failed, [str(exc)[:600] for exc in failed]
    verdict = compare(expected, table_ids(postgres_dsn, unique_name))
    assert verdict.exactly_once, verdict.summary()


@pytest.mark.parametrize(("protocol", "point", "connector"), with_connectors(CASES))
def test_postgres_sink_crash_once_then_restart_is_exactly_once(
    spark: Any, kafka: KafkaConfig, postgres_dsn: str, topic: str, unique_name: str, tmp_path: Path,
    crash_dir: Path, protocol: str, point: str, connector: str,
) -> None:
    expected = produce_input(kafka, topic, COUNT)
    keyed = protocol == "idempotent"
    create_table(postgres_dsn, unique_name, keyed)
    sink = postgres_sink(postgres_dsn, unique_name, protocol, key_columns=("id",) if keyed else ())
    checkpoint = str(tmp_path / "checkpoint")
    arm(crash_dir, point, batch_id=1)

    with pytest.raises(Exception):
        run_available_now(integers(spark, kafka, topic, PER_BATCH, connector=connector), sink, checkpoint)
    assert fired(crash_dir) == [point]

    query = run_available_now(integers(spark, kafka, topic, PER_BATCH, connector=connector), sink, checkpoint)
    assert read_by(query) == connector
    verdict = compare(expected, table_ids(postgres_dsn, unique_name))
    assert verdict.exactly_once, verdict.summary()
    assert prepared_transactions(postgres_dsn, unique_name) == []


def test_a_failed_batchs_straggler_is_rolled_back_by_the_driver_without_waiting_for_a_restart(
    spark: Any, kafka: KafkaConfig, postgres_dsn: str, topic: str, unique_name: str, tmp_path: Path, crash_dir: Path,
) -> None:
    """Spark fails a batch at its first failed task and kills the others without waiting; a
    killed task that had its whole input still prepares its transaction until its Python worker
    is destroyed (``spark.python.task.killTimeout``). The driver sweeps the failed run's
    leftovers again once such stragglers are gone (:data:`~oncekit.core.spark.query.STRAGGLER_S`
    after the failure), without holding the failure (and a restart) back meanwhile. The
    straggler here is a transaction prepared by hand under the failed run's epoch, right after
    the query failed; it holds the rows' locks and must not stay."""
    produce_input(kafka, topic, COUNT)
    create_table(postgres_dsn, unique_name, keyed=False)
    sink = postgres_sink(postgres_dsn, unique_name, "two-phase-commit")
    checkpoint = str(tmp_path / "checkpoint")
    arm(crash_dir, "task_after_pre_commit", batch_id=1)
    with pytest.raises(Exception):
        run_available_now(integers(spark, kafka, topic, PER_BATCH), sink, checkpoint)
    epoch = max(Journal(checkpoint, sink.sink_id).runs().values())
    straggler = str(TransactionId(sink.sink_id, 1, 1, 10_000, epoch))
    with psycopg.connect(postgres_dsn) as conn:
        conn.execute(f"INSERT INTO {unique_name} VALUES (-1, 'straggler')")
        conn.execute(f"PREPARE TRANSACTION '{straggler}'")
    assert prepared_after_the_sweep(postgres_dsn, unique_name) == []
    assert -1 not in table_ids(postgres_dsn, unique_name)


@pytest.mark.parametrize("notify", [True, False], ids=["listener", "no-listener"])
def test_postgres_two_phase_commit_same_keys_every_batch_never_waits_on_own_locks(
    spark: Any, kafka: KafkaConfig, postgres_dsn: str, topic: str, unique_name: str, tmp_path: Path, notify: bool,
) -> None:
    """Batch N+1 upserts the keys batch N left prepared; completion of N must reach Postgres
    before N+1's tasks write, whether or not a listener delivers notifications."""
    produce_input(kafka, topic, COUNT)
    create_table(postgres_dsn, unique_name, keyed=True)
    sink = postgres_sink(postgres_dsn, unique_name, "two-phase-commit", key_columns=("id",))
    frame = integers(spark, kafka, topic, PER_BATCH).selectExpr("id % 10 AS id", "payload").repartition(2, "id")
    query = start_query(frame, sink, str(tmp_path / "checkpoint"), trigger=Trigger(available_now=True), notify=notify)
    assert query.await_termination(timeout=240), "the query waited on its own prepared transactions"
    assert len(query.recentProgress) >= 4
    with psycopg.connect(postgres_dsn) as conn:
        rows = conn.execute(f"SELECT id, payload FROM {unique_name}").fetchall()
    assert sorted(r[0] for r in rows) == list(range(10))
    assert all(int(payload) % 10 == key for key, payload in rows)
    assert prepared_transactions(postgres_dsn, unique_name) == []


def test_listener_delivers_every_batch_and_the_termination_to_the_sink(
    spark: Any, kafka: KafkaConfig, postgres_dsn: str, topic: str, unique_name: str, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The checkpoint listener, which Spark calls through py4j with the Java events, hands the
    engine each progress event's batch and the query's termination, and the write-ahead log
    publishes from them: none of it is left for the caller's own commit after the wait."""
    notified: list[tuple[str, int | None]] = []
    deliver = CheckpointListener._notify

    def recorded(self: CheckpointListener, run_id: str, up_to: int | None) -> None:
        notified.append((run_id, up_to))
        deliver(self, run_id, up_to)

    monkeypatch.setattr(CheckpointListener, "_notify", recorded)
    expected = produce_input(kafka, topic, COUNT)
    create_table(postgres_dsn, unique_name, keyed=False)
    sink = postgres_sink(postgres_dsn, unique_name, "write-ahead-log")
    query = start_query(integers(spark, kafka, topic, PER_BATCH), sink, str(tmp_path / "checkpoint"),
                        trigger=Trigger(available_now=True))
    assert query.await_termination(timeout=240)
    run_id = str(query.runId)
    # Spark's listener bus delivers the termination on its own thread: await_termination waits
    # for it only while a completed batch is still uncommitted, and here none was.
    deadline = time.monotonic() + 30
    while query.watcher is not None and not query.watcher.terminated(run_id) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert query.watcher is not None and query.watcher.terminated(run_id)
    batches = [up_to for notified_id, up_to in notified if notified_id == run_id]
    assert [b for b in batches if b is not None] == list(range(len(query.recentProgress)))
    assert batches[-1] is None  # the termination
    verdict = compare(expected, table_ids(postgres_dsn, unique_name))
    assert verdict.exactly_once, verdict.summary()


def test_postgres_bad_row_fails_query_with_named_error_and_commits_nothing_of_batch(
    spark: Any, kafka: KafkaConfig, postgres_dsn: str, topic: str, unique_name: str, tmp_path: Path,
) -> None:
    produce_input(kafka, topic, COUNT)
    create_table(postgres_dsn, unique_name, keyed=False)
    sink = postgres_sink(postgres_dsn, unique_name, "two-phase-commit")
    frame = integers(spark, kafka, topic, PER_BATCH).selectExpr(
        "id", "CASE WHEN id = 500 THEN NULL ELSE payload END AS payload")
    with pytest.raises(Exception) as failure:
        run_available_now(frame, sink, str(tmp_path / "checkpoint"), notify=True)
    message = str(failure.value)
    assert f"sink {sink.sink_id} batch 1 partition 0" in message and "column payload" in message
    # Batch 0 completed and committed; nothing of batch 1 (which holds id 500) is visible.
    ids = table_ids(postgres_dsn, unique_name)
    assert 500 not in ids and len(ids) == PER_BATCH
    assert prepared_after_the_sweep(postgres_dsn, unique_name) == []


def test_supervisor_restarts_crashed_query_from_checkpoint_exactly_once(
    spark: Any, kafka: KafkaConfig, postgres_dsn: str, topic: str, unique_name: str, tmp_path: Path, crash_dir: Path,
) -> None:
    from oncekit.core.restart import FixedDelay, supervise

    expected = produce_input(kafka, topic, COUNT)
    create_table(postgres_dsn, unique_name, keyed=False)
    sink = postgres_sink(postgres_dsn, unique_name, "two-phase-commit")
    checkpoint = str(tmp_path / "checkpoint")
    arm(crash_dir, "driver_after_journal", batch_id=2)

    restarts = supervise(lambda: run_available_now(integers(spark, kafka, topic, PER_BATCH), sink, checkpoint),
                         FixedDelay(attempts=2, delay_s=0))

    assert restarts == 1 and fired(crash_dir) == ["driver_after_journal"]
    verdict = compare(expected, table_ids(postgres_dsn, unique_name))
    assert verdict.exactly_once, verdict.summary()
    assert prepared_transactions(postgres_dsn, unique_name) == []


def test_a_decided_batch_replayed_with_more_writer_partitions_is_not_written_twice(
    spark: Any, kafka: KafkaConfig, postgres_dsn: str, topic: str, unique_name: str, tmp_path: Path, crash_dir: Path,
) -> None:
    """Batch 1 is decided (journal and decision) and the driver's commit dies before Spark logs
    it; the job restarts with ``repartition(4)`` where it had ``repartition(2)``. Recovery commits
    the decided batch; Spark replays it with four writer tasks."""
    expected = produce_input(kafka, topic, COUNT)
    create_table(postgres_dsn, unique_name, keyed=False)
    sink = postgres_sink(postgres_dsn, unique_name, "two-phase-commit")
    checkpoint = str(tmp_path / "checkpoint")
    arm(crash_dir, "driver_after_journal", batch_id=1)
    with pytest.raises(Exception):  # noqa: B017 - the crash point fails the query, as Spark wraps it
        run_available_now(integers(spark, kafka, topic, PER_BATCH).repartition(2), sink, checkpoint)
    assert fired(crash_dir) == ["driver_after_journal"]

    run_available_now(integers(spark, kafka, topic, PER_BATCH).repartition(4), sink, checkpoint)

    verdict = compare(expected, table_ids(postgres_dsn, unique_name))
    assert verdict.exactly_once, verdict.summary()

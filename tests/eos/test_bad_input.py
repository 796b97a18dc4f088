"""Bad input and a changing world, each ending in a clear error (naming what and where) or a dead
letter, with nothing half-visible, and exactly-once after the fix and a restart.

Most cases drive the checkpoint engine directly on the real services (no Spark: a checkpoint
folder laid out as Spark lays it out, as in tests/integration/test_postgres_recovery.py); the
ones that are about Spark's own files or the source's offsets run a query on the shared session.
The docs' table of bad input (docs/verifying.md) names these tests; cases covered elsewhere are named there too.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pytest
from confluent_kafka import Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewPartitions  # type: ignore[attr-defined]

from oncekit.connectors import KafkaConfig
from oncekit.connectors.kafka_admin import end_offsets
from oncekit.core.engine import CheckpointEngine
from oncekit.core.errors import BadRecordError, CommitError, ConfigError, OncekitError, RecordError
from oncekit.core.protocol import Committable, SinkConfig, TaskInfo
from oncekit.core.spark_log import SparkLog
from oncekit.sinks.kafka import kafka_sink
from oncekit.sinks.postgres import postgres_sink
from oncekit.sources.kafka import kafka_stream
from oncekit.verify import compare
from tests.eos.pipeline import (
    PER_BATCH,
    integers,
    prepared_after_the_sweep,
    prepared_transactions,
    produce_input,
    read_committed,
    run_available_now,
    table_ids,
)

pytestmark = pytest.mark.services


# -- helpers: a checkpoint as Spark lays it out, batches through the engine ---------------------

def spark_logged(checkpoint: Path, batch_id: int, query_id: str = "") -> None:
    """Spark planned and committed ``batch_id`` (and, first, wrote the query's id)."""
    if not (checkpoint / "metadata").exists():
        checkpoint.mkdir(parents=True, exist_ok=True)
        (checkpoint / "metadata").write_text(json.dumps({"id": query_id or str(uuid.uuid4())}))
    for folder in ("offsets", "commits"):
        (checkpoint / folder).mkdir(parents=True, exist_ok=True)
        (checkpoint / folder / str(batch_id)).write_text("v1\n{}")


def engine_of(config: SinkConfig, checkpoint: Path) -> CheckpointEngine:
    """A (re)started query's engine: preflight and the run's start (epoch, recovery, claim), as
    the stream writer's first writer of a run does."""
    engine = CheckpointEngine.of(config, str(checkpoint))
    engine.preflight()
    engine.start_run(f"run-{uuid.uuid4().hex[:8]}")
    return engine


def run_batch(engine: CheckpointEngine, batch_id: int, partitions: list[pa.RecordBatch], checkpoint: Path) -> None:
    """Tasks write each partition, the driver journals, Spark logs the batch, completion commits;
    a task that fails makes the driver abort the batch, as Spark's writer abort does."""
    committables: list[Committable] = []
    try:
        for partition, rows in enumerate(partitions):
            committables += engine.write_task(TaskInfo(engine.sink.sink_id, batch_id, partition, batch_id * 10, engine.epoch),
                                              iter([rows]))
    except Exception:
        engine.abort(batch_id, committables)
        raise
    engine.checkpoint(batch_id, committables)
    spark_logged(checkpoint, batch_id)
    engine.complete(batch_id)


def table_rows(ids: list[int]) -> pa.RecordBatch:
    return pa.record_batch([pa.array(ids, pa.int32()), pa.array([str(i) for i in ids])], names=["id", "payload"])


def topic_rows(ids: list[int], size: int = 0) -> pa.RecordBatch:
    values = [("x" * size if size and i == ids[0] else str(i)).encode() for i in ids]
    return pa.record_batch([pa.array([str(i).encode() for i in ids]), pa.array(values)], names=["key", "value"])


@pytest.fixture
def table(postgres_dsn: str, unique_name: str) -> str:
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {unique_name} (id int NOT NULL, payload text NOT NULL)")
    return unique_name


def ids_of(dsn: str, table: str) -> list[int]:
    return sorted(table_ids(dsn, table))


# -- the target changed under a running query -------------------------------------------------

def test_target_table_dropped_mid_run_fails_naming_table_then_restart_exactly_once(
        postgres_dsn: str, table: str, tmp_path: Path) -> None:
    config = postgres_sink(postgres_dsn, table, "two-phase-commit", columns=("id", "payload"))
    engine = engine_of(config, tmp_path)
    run_batch(engine, 0, [table_rows([0, 2]), table_rows([1, 3])], tmp_path)
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(f"DROP TABLE {table}")
    with pytest.raises(OncekitError, match=rf"sink {config.sink_id} batch 1 partition 0: table {table}: relation .* does not exist"):
        run_batch(engine, 1, [table_rows([4, 6]), table_rows([5, 7])], tmp_path)
    assert prepared_transactions(postgres_dsn, table) == []
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:  # the fix: the table is back
        conn.execute(f"CREATE TABLE {table} (id int NOT NULL, payload text NOT NULL)")
    run_batch(engine_of(config, tmp_path), 1, [table_rows([4, 6]), table_rows([5, 7])], tmp_path)
    assert ids_of(postgres_dsn, table) == [4, 5, 6, 7]  # batch 0's rows went with the dropped table
    assert prepared_transactions(postgres_dsn, table) == []


def test_target_column_type_changed_mid_run_refuses_batch_naming_column_then_exactly_once(
        postgres_dsn: str, table: str, tmp_path: Path) -> None:
    config = postgres_sink(postgres_dsn, table, "two-phase-commit", columns=("id", "payload"))
    engine = engine_of(config, tmp_path)
    run_batch(engine, 0, [table_rows([0]), table_rows([1])], tmp_path)
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(f"ALTER TABLE {table} ALTER COLUMN id TYPE smallint")
    with pytest.raises(BadRecordError, match=rf"sink {config.sink_id} batch 1 partition 1: row 0 of the partition, column id: .*out of range"):
        run_batch(engine, 1, [table_rows([2]), table_rows([40_001])], tmp_path)
    assert ids_of(postgres_dsn, table) == [0, 1] and prepared_transactions(postgres_dsn, table) == []
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(f"ALTER TABLE {table} ALTER COLUMN id TYPE int")
    run_batch(engine_of(config, tmp_path), 1, [table_rows([2]), table_rows([40_001])], tmp_path)
    assert ids_of(postgres_dsn, table) == [0, 1, 2, 40_001]


def test_max_prepared_transactions_exhausted_fails_naming_setting_then_exactly_once(
        postgres_dsn: str, table: str, tmp_path: Path) -> None:
    config = postgres_sink(postgres_dsn, table, "two-phase-commit", columns=("id", "payload"))
    engine = engine_of(config, tmp_path)
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        free = int(conn.execute("SHOW max_prepared_transactions").fetchone()[0]) - int(  # type: ignore[index]
            conn.execute("SELECT count(*) FROM pg_prepared_xacts").fetchone()[0])  # type: ignore[index]
    fillers = []
    try:
        for i in range(free):  # someone else's forgotten prepared transactions take every slot
            conn = psycopg.connect(postgres_dsn)
            conn.execute(f"INSERT INTO {table} VALUES (-1, 'filler')")
            conn.execute(f"PREPARE TRANSACTION 'filler-{table}-{i}'")
            fillers.append(conn)
        with pytest.raises(CommitError, match=rf"sink {config.sink_id} batch 0 partition 0: PREPARE TRANSACTION refused: maximum number of prepared transactions reached \(Increase max_prepared_transactions"):
            run_batch(engine, 0, [table_rows([0]), table_rows([1])], tmp_path)
    finally:
        with psycopg.connect(postgres_dsn, autocommit=True) as conn:
            for i in range(len(fillers)):
                conn.execute(f"ROLLBACK PREPARED 'filler-{table}-{i}'")
        for filler in fillers:
            filler.close()
    run_batch(engine_of(config, tmp_path), 0, [table_rows([0]), table_rows([1])], tmp_path)
    assert ids_of(postgres_dsn, table) == [0, 1] and prepared_transactions(postgres_dsn, table) == []


# -- the output topic changed under a running query ---------------------------------------------

def test_output_topic_partitions_increased_mid_run_exactly_once(kafka: KafkaConfig, topic: str, tmp_path: Path) -> None:
    out = f"{topic}-out"
    config = kafka_sink(kafka.bootstrap_servers, out, "transactional")
    engine = engine_of(config, tmp_path)
    run_batch(engine, 0, [topic_rows([0, 2]), topic_rows([1, 3])], tmp_path)
    admin = AdminClient(kafka.settings())
    for future in admin.create_partitions([NewPartitions(out, 4)]).values():
        future.result(timeout=30)
    run_batch(engine, 1, [topic_rows([4, 6]), topic_rows([5, 7])], tmp_path)
    run_batch(engine_of(config, tmp_path), 1, [topic_rows([4, 6]), topic_rows([5, 7])], tmp_path)  # a replay
    verdict = compare(list(range(8)), [int(v) for v in read_committed(kafka, out, 8)])
    assert verdict.exactly_once, verdict.summary()


def test_output_topic_deleted_mid_run_fails_naming_topic_then_restart_exactly_once(
        kafka: KafkaConfig, topic: str, tmp_path: Path) -> None:
    out = f"{topic}-out"
    # A record for a deleted topic fails once the producer's delivery timeout (the transaction
    # timeout) has passed: 15 s here instead of the default minute.
    config = kafka_sink(kafka.bootstrap_servers, out, "transactional", transaction_timeout_ms=15_000)
    engine = engine_of(config, tmp_path)
    run_batch(engine, 0, [topic_rows([0]), topic_rows([1])], tmp_path)
    admin = AdminClient(kafka.settings())
    for future in admin.delete_topics([out], operation_timeout=30).values():
        future.result(timeout=30)
    with pytest.raises(OncekitError, match=rf"sink {config.sink_id} batch 1 partition 0: .*topic {out}") as failed:
        run_batch(engine, 1, [topic_rows([2]), topic_rows([3])], tmp_path)
    # The topic is gone, not a row bad: the error must not blame the user's row (issue 36, finding 5).
    assert not isinstance(failed.value, RecordError) and " row " not in str(failed.value), repr(failed.value)
    run_batch(engine_of(config, tmp_path), 1, [topic_rows([2]), topic_rows([3])], tmp_path)  # preflight recreates it
    verdict = compare([2, 3], [int(v) for v in read_committed(kafka, out, 2)])  # batch 0 went with the topic
    assert verdict.exactly_once, verdict.summary()


def test_oversized_record_fails_naming_row_then_dead_letter_topic_exactly_once(
        kafka: KafkaConfig, topic: str, tmp_path: Path) -> None:
    out, dead = f"{topic}-out", f"{topic}-dead"
    config = kafka_sink(kafka.bootstrap_servers, out, "transactional")
    engine = engine_of(config, tmp_path)
    with pytest.raises(RecordError, match=rf"sink {config.sink_id} batch 0 partition 0: row 0: .*too large"):
        run_batch(engine, 0, [topic_rows([0, 2], size=2_000_000), topic_rows([1, 3])], tmp_path)
    fixed = kafka_sink(kafka.bootstrap_servers, out, "transactional", dead_letter_topic=dead)
    run_batch(engine_of(fixed, tmp_path), 0, [topic_rows([0, 2], size=2_000_000), topic_rows([1, 3])], tmp_path)
    verdict = compare([1, 2, 3], [int(v) for v in read_committed(kafka, out, 3)])
    assert verdict.exactly_once, verdict.summary()
    assert len(read_committed(kafka, dead, 1)) == 1


# -- one sink id, two checkpoints -----------------------------------------------------------

@pytest.mark.parametrize("kind", ["postgres", "kafka"])
def test_same_sink_id_from_two_checkpoints_refused_at_start(
        kafka: KafkaConfig, postgres_dsn: str, table: str, tmp_path: Path, kind: str) -> None:
    config = postgres_sink(postgres_dsn, table, "two-phase-commit", columns=("id", "payload")) if kind == "postgres" \
        else kafka_sink(kafka.bootstrap_servers, table.replace("_", "-"), "transactional")
    first, second = tmp_path / "first", tmp_path / "second"
    spark_logged(first, 0)
    spark_logged(second, 0)
    engine_of(config, first)
    engine_of(config, first)  # a restart of the same query is its own owner
    with pytest.raises(ConfigError, match=rf"sink {config.sink_id}: already written by the query checkpointed at {first}"):
        engine_of(config, second)
    subprocess.run(["rm", "-rf", str(first)], check=True)  # the first query retired: its checkpoint deleted
    engine_of(config, second)


@pytest.mark.parametrize("protocol", ["postgres two-phase-commit", "postgres write-ahead-log",
                                      "kafka transactional", "kafka write-ahead-log"])
def test_a_new_checkpoint_taking_over_a_retired_querys_sink_id_commits_its_own_batches(
        kafka: KafkaConfig, postgres_dsn: str, table: str, tmp_path: Path, protocol: str) -> None:
    """The first query retired (its checkpoint deleted); a new query on a new checkpoint takes its
    sink id over and writes its own batch 1: the first query's records of batch 1 (marker rows,
    recorded checkpoints, marker topics) must not make the sink skip it as already committed."""
    kind, name = protocol.split()
    out = table.replace("_", "-")
    config = postgres_sink(postgres_dsn, table, name, columns=("id", "payload")) if kind == "postgres" \
        else kafka_sink(kafka.bootstrap_servers, out, name)
    rows = table_rows if kind == "postgres" else topic_rows
    first, second = tmp_path / "first", tmp_path / "second"
    spark_logged(first, 0)
    run_batch(engine_of(config, first), 1, [rows([0]), rows([1])], first)
    subprocess.run(["rm", "-rf", str(first)], check=True)  # the first query retired: its checkpoint deleted
    spark_logged(second, 0)
    run_batch(engine_of(config, second), 1, [rows([2]), rows([3])], second)
    got = ids_of(postgres_dsn, table) if kind == "postgres" else [int(v) for v in read_committed(kafka, out, 4)]
    verdict = compare([0, 1, 2, 3], got)
    assert verdict.exactly_once, verdict.summary()


def test_a_retired_querys_paused_driver_committing_during_a_takeovers_start_cannot_make_it_skip_a_batch(
        postgres_dsn: str, table: str, tmp_path: Path) -> None:
    """The first query's driver pauses with batch 1 prepared and journaled, not committed; its
    checkpoint is deleted and a new query takes the sink id over. The old driver wakes and commits
    its batch 1 in the middle of the new query's start (after the new query's checks, before its
    recovery): its marker rows of batch 1 must not make the sink skip the new query's batch 1 as
    committed. (A write-ahead-log driver cannot: its staged files went with its checkpoint.)"""
    config = postgres_sink(postgres_dsn, table, "two-phase-commit", columns=("id", "payload"))
    first, second = tmp_path / "first", tmp_path / "second"
    spark_logged(first, 0)
    old = engine_of(config, first)
    committables = [c for partition, part in enumerate([table_rows([0]), table_rows([1])])
                    for c in old.write_task(TaskInfo(config.sink_id, 1, partition, 10, old.epoch), iter([part]))]
    old.checkpoint(1, committables)  # journaled; the driver pauses before its commit
    subprocess.run(["rm", "-rf", str(first)], check=True)  # the first query retired: its checkpoint deleted
    spark_logged(second, 0)
    new = CheckpointEngine.of(config, str(second))
    new.preflight()
    old.sink.commit_batch(1, committables)  # the old driver wakes and commits its batch 1
    new.start_run("new-query")
    run_batch(new, 1, [table_rows([2]), table_rows([3])], second)
    got = ids_of(postgres_dsn, table)
    # The old driver's batch 1 is committed whole or not at all; the new query's batch 1 exactly once.
    assert got in ([2, 3], [0, 1, 2, 3]), got


# -- Spark's own files and the source's offsets -----------------------------------------------

def drain(spark: Any, kafka: KafkaConfig, topic: str, sink: SinkConfig, checkpoint: str) -> None:
    """(Re)start the example stream of ``topic`` into ``sink`` and run it until the input is drained."""
    run_available_now(integers(spark, kafka, topic, PER_BATCH), sink, checkpoint)


@pytest.mark.spark
def test_a_row_postgresql_refuses_in_a_task_is_caught_on_the_driver_as_bad_record_error(
        spark: Any, kafka: KafkaConfig, postgres_dsn: str, topic: str, table: str, tmp_path: Path) -> None:
    """A job's ``except BadRecordError`` catches a row the target refused in a task on an
    executor: the error crosses Spark as the kit's own class, with Spark's exception chained,
    and nothing of the batch is visible. After the fix a restart is exactly-once."""
    sink, checkpoint = postgres_sink(postgres_dsn, table, "two-phase-commit"), str(tmp_path / "checkpoint")
    expected = produce_input(kafka, topic, 100, first=40_000)
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(f"ALTER TABLE {table} ALTER COLUMN id TYPE smallint")
    try:
        drain(spark, kafka, topic, sink, checkpoint)
        raise AssertionError("the query wrote ids out of the column's range")
    except BadRecordError as exc:
        assert re.search(rf"sink {sink.sink_id} batch \d+ partition \d+: row \d+ of the partition, column id: .*out of range",
                         str(exc)), exc
        assert exc.__cause__ is not None and "StreamingQueryException" in type(exc.__cause__).__name__
    assert table_ids(postgres_dsn, table) == [] and prepared_after_the_sweep(postgres_dsn, table) == []
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(f"ALTER TABLE {table} ALTER COLUMN id TYPE int")
    drain(spark, kafka, topic, sink, checkpoint)
    verdict = compare(expected, table_ids(postgres_dsn, table))
    assert verdict.exactly_once, verdict.summary()


@pytest.fixture
def small_volume(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB tmpfs the test mounts (the tests run as root), unmounted afterwards."""
    mount = tmp_path / "volume"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def remount(spark: Any, volume: Path, mode: str) -> None:
    """Remount ``volume`` ``mode`` ("ro" or "rw"), first letting the JVM close what a failed write left open.

    When Hadoop's local file system fails to close a checkpoint file (the disk-full case), the
    stream stays open until the JVM collects it (seen here: ``offsets/.1.<uuid>.tmp`` held open
    for write), and Linux refuses to make a mount with a file open for write read-only.
    """
    for attempt in range(10):
        done = subprocess.run(["mount", "-o", f"remount,{mode}", str(volume)], capture_output=True, text=True)
        if done.returncode == 0:
            return
        spark._jvm.java.lang.System.gc()
        time.sleep(0.5 * attempt)
    holders = [f"{link.parent.parent.name}:{os.readlink(link)}" for link in Path("/proc").glob("[0-9]*/fd/*")
               if _points_into(link, volume)]
    raise AssertionError(f"remount,{mode} of {volume} failed: {done.stderr.strip()}; open there: {holders}")


def _points_into(link: Path, volume: Path) -> bool:
    try:
        return os.readlink(link).startswith(str(volume))
    except OSError:  # the process or descriptor went away meanwhile
        return False


@pytest.mark.spark
def test_checkpoint_full_or_read_only_fails_naming_it_then_exactly_once(
        spark: Any, kafka: KafkaConfig, postgres_dsn: str, topic: str, table: str, small_volume: Path) -> None:
    sink, checkpoint = postgres_sink(postgres_dsn, table, "two-phase-commit"), str(small_volume / "checkpoint")
    expected = produce_input(kafka, topic, 100)
    drain(spark, kafka, topic, sink, checkpoint)
    filler = small_volume / "filler"
    subprocess.run(["dd", "if=/dev/zero", f"of={filler}", "bs=1M", "count=32"], capture_output=True, check=False)
    expected += produce_input(kafka, topic, 100, first=100)
    with pytest.raises(Exception, match="No space left on device"):
        drain(spark, kafka, topic, sink, checkpoint)
    filler.unlink()
    drain(spark, kafka, topic, sink, checkpoint)
    remount(spark, small_volume, "ro")
    expected += produce_input(kafka, topic, 100, first=200)
    with pytest.raises(Exception, match="Read-only file system"):
        drain(spark, kafka, topic, sink, checkpoint)
    remount(spark, small_volume, "rw")
    drain(spark, kafka, topic, sink, checkpoint)
    verdict = compare(expected, table_ids(postgres_dsn, table))
    assert verdict.exactly_once, verdict.summary()
    assert prepared_transactions(postgres_dsn, table) == []


@pytest.mark.spark
def test_input_retention_took_offsets_the_checkpoint_needs_fails_naming_them(
        spark: Any, kafka: KafkaConfig, postgres_dsn: str, topic: str, table: str, tmp_path: Path) -> None:
    sink, checkpoint = postgres_sink(postgres_dsn, table, "two-phase-commit"), str(tmp_path / "checkpoint")
    expected = produce_input(kafka, topic, 100)
    drain(spark, kafka, topic, sink, checkpoint)
    expected += produce_input(kafka, topic, 100, first=100)
    read = SparkLog(checkpoint).source_offsets(SparkLog(checkpoint).latest_completed() or 0)[0][topic]
    ends = end_offsets(kafka, topic)
    cut = {int(p): (int(o) + ends[int(p)]) // 2 for p, o in read.items()}  # into what the checkpoint has not read
    admin = AdminClient(kafka.settings())
    for future in admin.delete_records([TopicPartition(topic, p, o) for p, o in cut.items()]).values():
        future.result(timeout=30)
    with pytest.raises(Exception, match=rf"topic {topic} partition \d: offsets \d+\.\.\d+ are gone"):
        drain(spark, kafka, topic, sink, checkpoint)
    lenient = kafka_stream(spark, kafka.bootstrap_servers, topic, failOnDataLoss="false").selectExpr(
        "TRY_CAST(CAST(value AS STRING) AS INT) AS id", "CAST(value AS STRING) AS payload").where("id IS NOT NULL")
    run_available_now(lenient, sink, checkpoint)  # the fix: accept the loss and go on
    got = table_ids(postgres_dsn, table)
    assert len(got) == len(set(got)) and set(expected[:100]) <= set(got) and set(got) <= set(expected)
    assert len(got) < len(expected)  # what retention deleted is gone, nothing else


@pytest.mark.spark
def test_record_whose_schema_changed_mid_stream_goes_to_dead_letters_rest_exactly_once(
        spark: Any, kafka: KafkaConfig, postgres_dsn: str, topic: str, table: str, tmp_path: Path) -> None:
    producer = Producer(kafka.settings())
    for i in range(40):  # from record 30 on, the producer renamed "payload" and made "id" a string
        value = {"id": i, "payload": f"p{i}"} if i < 30 else {"id": f"#{i}", "note": f"p{i}"}
        producer.produce(topic, value=json.dumps(value).encode(), partition=i % 2)
    producer.flush(30)
    frame = kafka_stream(spark, kafka.bootstrap_servers, topic).selectExpr(
        "from_json(CAST(value AS STRING), 'id INT, payload STRING') AS r").selectExpr("r.id AS id", "r.payload AS payload")
    sink = postgres_sink(postgres_dsn, table, "two-phase-commit", dead_letter_table=f"{table}_dead")
    run_available_now(frame, sink, str(tmp_path / "checkpoint"))
    run_available_now(frame, sink, str(tmp_path / "checkpoint"))  # a restart replays nothing
    verdict = compare(list(range(30)), table_ids(postgres_dsn, table))
    assert verdict.exactly_once, verdict.summary()
    with psycopg.connect(postgres_dsn) as conn:
        dead = conn.execute(f"SELECT error FROM {table}_dead").fetchall()
    assert len(dead) == 10 and all("null value in column" in e for (e,) in dead), dead

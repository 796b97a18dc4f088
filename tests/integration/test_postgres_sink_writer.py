"""The PostgreSQL sinks' task and driver methods on a real server, without Spark: pooled
connections, one COPY per partition, staging tables reused across batches, Arrow-rendered bytes
and JSON, refused rows with and without a dead-letter table."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pytest

from oncekit.core.protocol import Committable, TaskInfo
from oncekit.sinks.postgres import BadRecordError, postgres_sink
from oncekit.sinks.postgres._pool import POOL

pytestmark = pytest.mark.services

PROTOCOLS = ["two-phase-commit", "write-ahead-log", "idempotent", "at-least-once"]


def create_table(dsn: str, name: str, columns: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {name} ({columns})")


def new_sink(dsn: str, table: str, checkpoint: Path, protocol: str, keyed: bool, **options: Any) -> Any:
    """The configuration of a sink into a new table (id, payload), preflighted."""
    create_table(dsn, table, f"id int {'PRIMARY KEY' if keyed else 'NOT NULL'}, payload text NOT NULL")
    config = postgres_sink(dsn, table, protocol, key_columns=("id",) if keyed else (), columns=("id", "payload"),
                           **options)
    config.build(str(checkpoint)).preflight()
    return config


def rows(ids: list[int], payload: str | None = None) -> pa.RecordBatch:
    return pa.record_batch([pa.array(ids, pa.int32()), pa.array([payload or str(i) for i in ids])],
                           names=["id", "payload"])


def content(dsn: str, table: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn) as conn:
        return sorted(conn.execute(f"SELECT * FROM {table}").fetchall())


def as_list(written: Any) -> list[Committable]:
    """What write_partition returned, as a list (one committable, none, or several)."""
    if written is None:
        return []
    return list(written) if isinstance(written, list) else [written]


_epochs: dict[tuple[str, str], int] = {}


def epoch_of(config: Any, checkpoint: str) -> int:
    """The epoch of the test's one query run on ``config``'s sink, taken at the target once."""
    key = (config.sink_id, checkpoint)
    if key not in _epochs:
        _epochs[key] = config.build(checkpoint).take_epoch(0)
    return _epochs[key]


def built(config: Any, checkpoint: str) -> Any:
    """A sink object acting for the test's run."""
    sink = config.build(checkpoint)
    sink.act_for(epoch_of(config, checkpoint))
    return sink


def run_batch(config: Any, checkpoint: str, batch_id: int, partitions: dict[int, list[pa.RecordBatch]],
              attempt: int = 0) -> None:
    """Tasks write each partition through a sink object of their own, then the driver decides the
    batch (two-phase commit) and commits, in the engine's order."""
    committables = []
    for partition, batches in partitions.items():
        task = TaskInfo(config.sink_id, batch_id, partition, attempt, epoch_of(config, checkpoint))
        committables += as_list(built(config, checkpoint).write_partition(task, iter(batches)))
    driver = built(config, checkpoint)
    driver.decide(batch_id, committables)
    driver.commit_batch(batch_id, committables)


def prepared(dsn: str, sink_id: str) -> list[str]:
    """The sink's prepared transactions still open."""
    with psycopg.connect(dsn) as conn:
        return [r[0] for r in conn.execute("SELECT gid FROM pg_prepared_xacts WHERE starts_with(gid, %s)",
                                           (f"oncekit:{sink_id}:",))]


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_postgres_sink_keyed_batches_last_row_of_key_wins_and_replay_changes_nothing(
    postgres_dsn: str, unique_name: str, tmp_path: Path, protocol: str,
) -> None:
    config = new_sink(postgres_dsn, unique_name, tmp_path, protocol, keyed=True)
    for batch_id in (0, 1):
        partitions = {p: [rows([10 * p + 1, 10 * p + 2], f"{batch_id}a"), rows([10 * p + 2, 10 * p + 3], f"{batch_id}b")]
                      for p in (0, 1)}
        run_batch(config, str(tmp_path), batch_id, partitions)
    expected = [(1, "1a"), (2, "1b"), (3, "1b"), (11, "1a"), (12, "1b"), (13, "1b")]
    assert content(postgres_dsn, unique_name) == expected
    run_batch(config, str(tmp_path), 1, {p: [rows([10 * p + 2], "1b")] for p in (0, 1)}, attempt=7)
    assert content(postgres_dsn, unique_name) == expected
    assert prepared(postgres_dsn, config.sink_id) == []


def staging_tables(dsn: str) -> dict[str, int]:
    """Every unlogged staging table in the database with its row count."""
    with psycopg.connect(dsn) as conn:
        names = [r[0] for r in conn.execute(
            "SELECT relname FROM pg_class WHERE relpersistence = 'u' AND relname LIKE 'oncekit_stage_%'")]
        return {name: conn.execute(f"SELECT count(*) FROM {name}").fetchone()[0] for name in names}  # type: ignore[index]


def test_postgres_two_phase_commit_staging_tables_reused_and_empty_after_each_batch(
    postgres_dsn: str, unique_name: str, tmp_path: Path,
) -> None:
    config = new_sink(postgres_dsn, unique_name, tmp_path, "two-phase-commit", keyed=True)
    before = staging_tables(postgres_dsn)
    run_batch(config, str(tmp_path), 0, {p: [rows([p, p + 2])] for p in (0, 1)})
    made = set(staging_tables(postgres_dsn)) - set(before)
    for batch_id in (1, 2):
        run_batch(config, str(tmp_path), batch_id, {p: [rows([p, p + 2], str(batch_id))] for p in (0, 1)})
    after = staging_tables(postgres_dsn)
    assert len(made) == 2 and set(after) - set(before) == made
    assert all(after[name] == 0 for name in made)
    assert content(postgres_dsn, unique_name) == [(0, "2"), (1, "2"), (2, "2"), (3, "2")]


def test_postgres_sink_pool_reuses_connection_and_replaces_one_the_server_ended(
    postgres_dsn: str, unique_name: str, tmp_path: Path,
) -> None:
    config = new_sink(postgres_dsn, unique_name, tmp_path, "two-phase-commit", keyed=False)
    sink = config.build(str(tmp_path))
    with sink.target.session() as conn:  # type: ignore[attr-defined]
        first = conn.info.backend_pid
    run_batch(config, str(tmp_path), 0, {0: [rows([1])]})
    with sink.target.session() as conn:  # type: ignore[attr-defined]
        assert conn.info.backend_pid == first
    with psycopg.connect(postgres_dsn, autocommit=True) as admin:
        # Waits (5 s at most) until the session has ended and told its client so.
        admin.execute("SELECT pg_terminate_backend(%s, 5000)", (first,))
    run_batch(config, str(tmp_path), 1, {0: [rows([2])]})
    assert content(postgres_dsn, unique_name) == [(1, "1"), (2, "2")]
    assert prepared(postgres_dsn, config.sink_id) == []


def test_postgres_two_phase_commit_prepares_on_connection_that_used_temporary_staging(
    postgres_dsn: str, unique_name: str, tmp_path: Path,
) -> None:
    """A pooled session keeps the idempotent sink's temporary table; a later two-phase
    transaction on it must not touch that table, or PREPARE would refuse."""
    POOL.close_all()
    two_phase = new_sink(postgres_dsn, unique_name, tmp_path, "two-phase-commit", keyed=True, sink_id=f"{unique_name}-2pc")
    idempotent = postgres_sink(postgres_dsn, unique_name, "idempotent", key_columns=("id",), columns=("id", "payload"))
    run_batch(idempotent, str(tmp_path), 0, {0: [rows([1, 2])]})
    run_batch(two_phase, str(tmp_path), 0, {0: [rows([2, 3], "x")]})
    assert content(postgres_dsn, unique_name) == [(1, "1"), (2, "x"), (3, "x")]


@pytest.mark.parametrize("keyed", [False, True], ids=["append", "merge"])
def test_postgres_sink_bad_row_in_later_arrow_batch_names_its_row_in_partition(
    postgres_dsn: str, unique_name: str, tmp_path: Path, keyed: bool,
) -> None:
    config = new_sink(postgres_dsn, unique_name, tmp_path, "two-phase-commit", keyed)
    bad = pa.record_batch([pa.array([4, 5, 6], pa.int32()), pa.array(["d", None, "f"])], names=["id", "payload"])
    with pytest.raises(BadRecordError, match=rf"batch 3 partition 1: row 4 of the partition, column payload"):
        built(config, str(tmp_path)).write_partition(TaskInfo(config.sink_id, 3, 1, 0, epoch_of(config, str(tmp_path))),
                                                     iter([rows([1, 2, 3]), bad]))
    assert prepared(postgres_dsn, config.sink_id) == []
    assert content(postgres_dsn, unique_name) == []


@pytest.mark.parametrize("keyed", [False, True], ids=["append", "merge"])
def test_postgres_sink_dead_letter_takes_only_refused_rows_across_arrow_batches(
    postgres_dsn: str, unique_name: str, tmp_path: Path, keyed: bool,
) -> None:
    config = new_sink(postgres_dsn, unique_name, tmp_path, "two-phase-commit", keyed, dead_letter_table=f"{unique_name}_dead")
    first = pa.record_batch([pa.array([1, 2], pa.int32()), pa.array([None, "b"])], names=["id", "payload"])
    second = pa.record_batch([pa.array([3, 4, 5], pa.int32()), pa.array(["c", None, "e"])], names=["id", "payload"])
    run_batch(config, str(tmp_path), 0, {0: [first, rows([10, 11]), second]})
    assert [r[0] for r in content(postgres_dsn, unique_name)] == [2, 3, 5, 10, 11]
    with psycopg.connect(postgres_dsn) as conn:
        dead = conn.execute(f"SELECT row_number, record->>'id', error FROM {unique_name}_dead ORDER BY row_number").fetchall()
    assert [(r[0], r[1]) for r in dead] == [(0, "1"), (5, "4")] and all("null value" in r[2] for r in dead)
    assert prepared(postgres_dsn, config.sink_id) == []


def test_postgres_sink_bytes_and_nested_columns_arrive_as_bytea_and_jsonb(
    postgres_dsn: str, unique_name: str, tmp_path: Path,
) -> None:
    create_table(postgres_dsn, unique_name, "id int NOT NULL, blob bytea, doc jsonb, tags jsonb, attrs jsonb")
    config = postgres_sink(postgres_dsn, unique_name, "at-least-once", columns=("id", "blob", "doc", "tags", "attrs"))
    config.build(str(tmp_path)).preflight()
    doc_type = pa.struct([("name", pa.string()), ("score", pa.float64()), ("ok", pa.bool_()), ("raw", pa.binary())])
    batch = pa.record_batch([
        pa.array([1, 2, 3], pa.int32()),
        pa.array([b"\x00\xff\x10", None, b""]),
        pa.array([{"name": 'say "hi"\n\\', "score": 1.5, "ok": True, "raw": b"\x01"}, None,
                  {"name": None, "score": None, "ok": False, "raw": None}], doc_type),
        pa.array([["a", "b"], [], None], pa.list_(pa.string())),
        pa.array([[("k", 1), ("j", None)], None, []], pa.map_(pa.string(), pa.int64())),
    ], names=["id", "blob", "doc", "tags", "attrs"])
    run_batch(config, str(tmp_path), 0, {0: [batch.slice(0, 1), batch.slice(1)]})
    got = content(postgres_dsn, unique_name)
    assert got == [
        (1, b"\x00\xff\x10", {"name": 'say "hi"\n\\', "score": 1.5, "ok": True, "raw": "\\x01"}, ["a", "b"],
         {"k": 1, "j": None}),
        (2, None, None, [], None),
        (3, b"", {"name": None, "score": None, "ok": False, "raw": None}, None, {}),
    ]
    assert json.dumps(got[0][2], sort_keys=True)


@pytest.mark.parametrize("protocol", ["two-phase-commit", "idempotent"])
def test_postgres_sink_on_conflict_nothing_keeps_first_row_of_key(
    postgres_dsn: str, unique_name: str, tmp_path: Path, protocol: str,
) -> None:
    config = new_sink(postgres_dsn, unique_name, tmp_path, protocol, keyed=True, on_conflict="nothing")
    run_batch(config, str(tmp_path), 0, {0: [rows([1, 2], "first"), rows([2, 3], "second")]})
    run_batch(config, str(tmp_path), 1, {0: [rows([3, 4], "third")]})
    assert content(postgres_dsn, unique_name) == [(1, "first"), (2, "first"), (3, "second"), (4, "third")]


@pytest.mark.parametrize("zone", ["America/New_York", "UTC", "Etc/UTC"])
def test_postgres_sink_timestamps_arrive_as_the_same_instants(
    postgres_dsn: str, unique_name: str, tmp_path: Path, zone: str,
) -> None:
    """A zoned timestamp is the same instant in a timestamptz column and its wall time in its
    zone (Spark's session time zone, as Spark's JDBC writer does) in a timestamp column; a naive
    one is its wall time; NULL stays NULL."""
    from datetime import datetime, timezone
    from zoneinfo import ZoneInfo

    create_table(postgres_dsn, unique_name, "id int NOT NULL, zoned timestamptz, zoned_wall timestamp, naive timestamp")
    config = postgres_sink(postgres_dsn, unique_name, "at-least-once", columns=("id", "zoned", "zoned_wall", "naive"))
    config.build(str(tmp_path)).preflight()
    micros = [1_700_000_000_123_456, None, 0]
    zoned = pa.array(micros, pa.timestamp("us", tz=zone))
    batch = pa.record_batch([pa.array([1, 2, 3], pa.int32()), zoned, zoned, pa.array(micros, pa.timestamp("us"))],
                            names=["id", "zoned", "zoned_wall", "naive"])
    run_batch(config, str(tmp_path), 0, {0: [batch]})
    instants = [datetime(2023, 11, 14, 22, 13, 20, 123456, timezone.utc), datetime(1970, 1, 1, tzinfo=timezone.utc)]
    want = [(1, instants[0], instants[0].astimezone(ZoneInfo(zone)).replace(tzinfo=None), instants[0].replace(tzinfo=None)),
            (2, None, None, None),
            (3, instants[1], instants[1].astimezone(ZoneInfo(zone)).replace(tzinfo=None), instants[1].replace(tzinfo=None))]
    assert content(postgres_dsn, unique_name) == want


def test_postgres_sinks_preflighted_side_by_side_on_a_new_schema_all_pass(
    postgres_dsn: str, unique_name: str, tmp_path: Path,
) -> None:
    """Sinks that start at the same moment (the targets of a fan-out, two jobs) create the kit's
    tables in their schema at once; PostgreSQL's CREATE TABLE IF NOT EXISTS is not safe against
    a concurrent one (a unique violation on the catalog), and no preflight may fail for it."""
    for round_ in range(4):
        schema = f"{unique_name}_{round_}"
        with psycopg.connect(postgres_dsn, autocommit=True) as conn:
            conn.execute(f"CREATE SCHEMA {schema}")
        sinks = []
        for index, protocol in enumerate(["two-phase-commit", "write-ahead-log"] * 3):
            table = f"{schema}.t{index}"
            create_table(postgres_dsn, table, "id int NOT NULL, payload text NOT NULL")
            sinks.append(postgres_sink(postgres_dsn, table, protocol, columns=("id", "payload"),
                                       dead_letter_table=f"{schema}.dead_letters").build(str(tmp_path / schema)))
        start = threading.Barrier(len(sinks))
        failed: list[BaseException] = []

        def preflight(sink: Any) -> None:
            start.wait()
            try:
                sink.preflight()
            except BaseException as exc:
                failed.append(exc)

        threads = [threading.Thread(target=preflight, args=(sink,)) for sink in sinks]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert failed == [], [f"{type(exc).__name__}: {exc}" for exc in failed]

"""The two-phase-commit sink's marker table over months, on a real PostgreSQL server: Spark's task
attempt id is a 64-bit counter that grows for as long as the application runs, and the marker
table made by earlier kit versions stored it in an ``int``, so past 2^31 every PREPARE failed
and the query crash-looped. New tables hold a bigint; old ones are migrated at start when no
prepared transaction holds the table, and hold the attempt's low bits until then."""

from __future__ import annotations

from pathlib import Path

import psycopg
import pyarrow as pa
import pytest

from oncekit.core.protocol import TaskInfo
from oncekit.sinks.postgres import postgres_sink
from oncekit.sinks.postgres._schema import _bigint_attempt as _BIGINT_ATTEMPT

pytestmark = pytest.mark.services

BIG_ATTEMPT = 2**31 + 7


def attempt_type(conn: psycopg.Connection, schema: str) -> str:
    row = conn.execute("SELECT format_type(atttypid, atttypmod) FROM pg_attribute "
                       "WHERE attrelid = %s::regclass AND attname = 'attempt'", (f"{schema}.oncekit_markers",)).fetchone()
    assert row is not None
    return str(row[0])


def test_attempt_past_two_to_the_31_prepares_and_an_old_int_table_is_migrated(
        postgres_dsn: str, unique_name: str, tmp_path: Path) -> None:
    schema = unique_name
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
        conn.execute(f"CREATE TABLE {schema}.target (id int NOT NULL)")
        # what earlier kit versions made
        conn.execute(f"CREATE TABLE {schema}.oncekit_markers (transaction_id text PRIMARY KEY, sink_id text NOT NULL, "
                     "batch_id bigint NOT NULL, partition_id int NOT NULL, attempt int NOT NULL, rows bigint NOT NULL, "
                     "prepared_at timestamptz NOT NULL DEFAULT now())")
        conn.execute(f"CREATE TABLE {schema}.oncekit_sinks (sink_id text PRIMARY KEY, query_id text NOT NULL, "
                     "checkpoint text NOT NULL, claimed_at timestamptz NOT NULL DEFAULT now(), epoch bigint NOT NULL "
                     "DEFAULT 0)")
        # what this version's first preflight made while an old prepared transaction deferred the migration
        conn.execute(f"CREATE TABLE {schema}.oncekit_decisions (sink_id text NOT NULL, batch_id bigint NOT NULL, "
                     "epoch bigint NOT NULL, verdict text NOT NULL, PRIMARY KEY (sink_id, batch_id, epoch))")
    config = postgres_sink(postgres_dsn, f"{schema}.target", "two-phase-commit", columns=("id",))
    sink = config.build(str(tmp_path))
    sink.act_for(sink.take_epoch(0))
    batch = pa.record_batch([pa.array([1, 2], pa.int32())], names=["id"])

    # A prepared transaction of the old table holds its lock: the migration waits 3 s and defers.
    held = sink.write_partition(TaskInfo(config.sink_id, 0, 0, 5, sink.epoch), iter([batch]))
    _BIGINT_ATTEMPT.clear()
    sink.preflight()
    with psycopg.connect(postgres_dsn) as conn:
        assert attempt_type(conn, schema) == "integer"
    (big,) = sink.write_partition(TaskInfo(config.sink_id, 1, 0, BIG_ATTEMPT, sink.epoch), iter([batch]))  # low bits meanwhile
    sink.commit_batch(0, held)
    sink.commit_batch(1, [big])

    _BIGINT_ATTEMPT.clear()
    sink.preflight()  # nothing prepared now: migrated
    with psycopg.connect(postgres_dsn) as conn:
        assert attempt_type(conn, schema) == "bigint"
    (bigger,) = sink.write_partition(TaskInfo(config.sink_id, 2, 0, BIG_ATTEMPT, sink.epoch), iter([batch]))
    sink.commit_batch(2, [bigger])
    with psycopg.connect(postgres_dsn) as conn:
        stored = dict(conn.execute(f"SELECT batch_id, attempt FROM {schema}.oncekit_markers").fetchall())
        assert stored == {0: 5, 1: BIG_ATTEMPT % 2**31, 2: BIG_ATTEMPT}
        assert conn.execute(f"SELECT count(*) FROM {schema}.target").fetchone() == (6,)

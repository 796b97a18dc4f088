"""The kit's tables beside a PostgreSQL sink's target, made and checked at a query's start
(the psycopg target's preflight, :mod:`oncekit.sinks.postgres._psycopg`), and the staging tables
its partition writer merges through.

Staging tables (only where ``key_columns`` are declared) are made once and reused:

- temporary ``oncekit_stage_<digest>`` per pooled connection and target, for the protocols that
  commit in the task or on the driver (idempotent, at-least-once, write-ahead log);
- unlogged ``oncekit_stage_<digest>_<partition>`` in the target's schema per (sink, stream
  columns, partition), for two-phase commit (PostgreSQL cannot PREPARE a transaction that
  touched a temporary table). The transaction empties it with TRUNCATE, so it never holds dead
  rows; concurrent attempts of one partition wait for each other there (a deadlock between them
  fails one attempt, which Spark retries). They hold no data between transactions and may be
  dropped whenever no query runs.
"""

from __future__ import annotations

import hashlib
import logging
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import sql

from oncekit.connectors.postgres import check_server
from oncekit.core.errors import ConfigError
from oncekit.sinks.postgres._common import (CHECKPOINT_TABLE, DECISION_TABLE, FORMAT, MARKER_TABLE, OWNER_TABLE,
                                            PARTITION_TABLE, in_schema_of)
from oncekit.sinks.postgres._table_writer import ORDINAL, identifier

if TYPE_CHECKING:
    from oncekit.core.protocol import TaskInfo
    from oncekit.sinks.postgres.config import PostgresSinkConfig

logger = logging.getLogger(__name__)

MARKER_INDEX = f"{MARKER_TABLE}_batch_partition"
"""The marker table's unique index on (sink_id, batch_id, partition_id)."""
DDL_LOCK = "oncekit-ddl"
"""The advisory lock's name (hashed to its key) that :func:`kit_ddl` holds."""

# Temporary staging tables each pooled connection has made (they live as long as its session).
_temporary_tables: weakref.WeakKeyDictionary[psycopg.Connection[Any], set[str]] = weakref.WeakKeyDictionary()
# Unlogged staging tables this process has made, by connection string.
_unlogged_tables: set[tuple[str, str]] = set()
_bigint_attempt: dict[str, bool] = {}  # marker table: whether its attempt column is bigint (per process)


def add_once(conn: psycopg.Connection[Any], table: str, what: str, exists: str, statement: sql.Composed) -> None:
    """Driver, preflight (autocommit ``conn``): add ``what`` to the kit's table ``table`` (made by
    an older kit) unless ``exists`` (a query with the table's name as its one parameter) finds it.
    The change needs a lock that prepared transactions hold off until recovery finishes them,
    which comes after the preflight: it waits 3 s at most, and is tried again at the next start."""
    if conn.execute(exists, (table,)).fetchone() is not None:
        return
    try:
        with conn.transaction():
            conn.execute("SET LOCAL lock_timeout = '3s'")
            conn.execute(statement)
        logger.warning("table %s: %s added", table, what)
    except psycopg.errors.LockNotAvailable:
        logger.warning("table %s: %s not added yet (prepared transactions hold the table); tried again at the next "
                       "start", table, what)


@contextmanager
def kit_ddl(conn: psycopg.Connection[Any]) -> Iterator[None]:
    """Driver, preflight (autocommit ``conn``): one session of the database at a time creates or
    changes the kit's tables. CREATE ... IF NOT EXISTS is not safe against a concurrent one
    (PostgreSQL answers a unique violation on its catalog), and sinks start side by side (a
    fan-out's targets, two jobs). A session-level advisory lock, so that :func:`add_once`'s own
    transactions run inside it; the server releases it if the session dies."""
    conn.execute("SELECT pg_advisory_lock(hashtext(%s))", (DDL_LOCK,))
    try:
        yield
    finally:
        conn.execute("SELECT pg_advisory_unlock(hashtext(%s))", (DDL_LOCK,))


def preflight(config: PostgresSinkConfig, conn: psycopg.Connection[Any]) -> None:
    """Driver, at query start (autocommit ``conn``): the server takes the protocol (prepared
    transactions for two-phase commit), the target exists with the stream's columns and keys, and
    the kit's own tables exist."""
    check_server(config.dsn)  # a refused password or certificate fails here by name, the DSN's password hidden
    if config.protocol == "two-phase-commit":
        row = conn.execute("SHOW max_prepared_transactions").fetchone()
        if row is None or int(row[0]) == 0:
            raise ConfigError(f"{FORMAT} sink {config.sink_id}: the server has max_prepared_transactions = 0; set it "
                              "above the number of partitions times two (postgres -c max_prepared_transactions=64) "
                              "and restart it")
    if conn.execute("SELECT to_regclass(%s)", (config.table,)).fetchone() == (None,):
        raise ConfigError(f"{FORMAT} sink {config.sink_id}: table {config.table} does not exist")
    with conn.cursor() as cur:
        cur.execute(sql.SQL("SELECT * FROM {} LIMIT 0").format(identifier(config.table)))
        existing = [d.name for d in cur.description or []]
    missing = [c for c in (*config.columns, *config.key_columns) if c not in existing]
    if missing:
        raise ConfigError(f"{FORMAT} sink {config.sink_id}: table {config.table} has no column(s) "
                          f"{', '.join(sorted(set(missing)))}; it has {', '.join(existing)}")
    if config.key_columns:
        _check_conflict_target(config, conn)
    with kit_ddl(conn):
        _create_tables(config, conn)


def _check_conflict_target(config: PostgresSinkConfig, conn: psycopg.Connection[Any]) -> None:
    keys = sql.SQL(", ").join(sql.Identifier(c) for c in config.key_columns)
    try:
        conn.execute(sql.SQL("EXPLAIN INSERT INTO {} ({}) SELECT {} FROM {} WHERE false ON CONFLICT ({}) DO NOTHING").format(
            identifier(config.table), keys, keys, identifier(config.table), keys))
    except psycopg.errors.InvalidColumnReference as exc:
        raise ConfigError(f"{FORMAT} sink {config.sink_id}: table {config.table} needs a unique index on "
                          f"({', '.join(config.key_columns)}) for key_columns") from exc


def _create_tables(config: PostgresSinkConfig, conn: psycopg.Connection[Any]) -> None:
    owners = in_schema_of(config.table, OWNER_TABLE)
    conn.execute(sql.SQL(
        "CREATE TABLE IF NOT EXISTS {} (sink_id text PRIMARY KEY, query_id text NOT NULL, checkpoint text NOT NULL, "
        "claimed_at timestamptz NOT NULL DEFAULT now(), epoch bigint NOT NULL DEFAULT 0)").format(identifier(owners)))
    add_once(conn, owners, "epoch column", "SELECT 1 FROM pg_attribute WHERE attrelid = %s::regclass AND attname = 'epoch'",
             sql.SQL("ALTER TABLE {} ADD COLUMN IF NOT EXISTS epoch bigint NOT NULL DEFAULT 0").format(identifier(owners)))
    if config.dead_letter_table:
        conn.execute(sql.SQL(
            "CREATE TABLE IF NOT EXISTS {} (sink_id text NOT NULL, batch_id bigint NOT NULL, partition_id int NOT NULL, "
            "row_number bigint NOT NULL, record jsonb, error text NOT NULL, created_at timestamptz NOT NULL DEFAULT now())"
        ).format(identifier(config.dead_letter_table)))
    if config.protocol == "two-phase-commit":
        _create_two_phase_tables(config, conn)
    elif config.protocol == "idempotent":
        conn.execute(sql.SQL(
            "CREATE TABLE IF NOT EXISTS {} (sink_id text NOT NULL, partition_id int NOT NULL, batch_id bigint NOT NULL, "
            "PRIMARY KEY (sink_id, partition_id))").format(identifier(in_schema_of(config.table, PARTITION_TABLE))))
    elif config.protocol == "write-ahead-log":
        conn.execute(sql.SQL(
            "CREATE TABLE IF NOT EXISTS {} (sink_id text NOT NULL, batch_id bigint NOT NULL, rows bigint NOT NULL, "
            "committed_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (sink_id, batch_id))"
        ).format(identifier(in_schema_of(config.table, CHECKPOINT_TABLE))))


def _create_two_phase_tables(config: PostgresSinkConfig, conn: psycopg.Connection[Any]) -> None:
    markers = identifier(in_schema_of(config.table, MARKER_TABLE))
    conn.execute(sql.SQL(
        "CREATE TABLE IF NOT EXISTS {} (transaction_id text PRIMARY KEY, sink_id text NOT NULL, batch_id bigint NOT NULL, "
        "partition_id int NOT NULL, attempt bigint NOT NULL, rows bigint NOT NULL, prepared_at timestamptz NOT NULL DEFAULT now())"
    ).format(markers))
    conn.execute(sql.SQL(
        "CREATE TABLE IF NOT EXISTS {} (sink_id text NOT NULL, batch_id bigint NOT NULL, epoch bigint NOT NULL, "
        "verdict text NOT NULL CHECK (verdict IN ('decided', 'vetoed')), recorded_at timestamptz NOT NULL DEFAULT now(), "
        "PRIMARY KEY (sink_id, batch_id, epoch))").format(identifier(in_schema_of(config.table, DECISION_TABLE))))
    index = in_schema_of(config.table, MARKER_INDEX)
    try:
        add_once(conn, index, "unique index on (sink_id, batch_id, partition_id)",
                 "SELECT 1 WHERE to_regclass(%s) IS NOT NULL",
                 sql.SQL("CREATE UNIQUE INDEX IF NOT EXISTS {} ON {} (sink_id, batch_id, partition_id)").format(
                     sql.Identifier(MARKER_INDEX), markers))
    except psycopg.errors.UniqueViolation as exc:
        raise ConfigError(
            f"{FORMAT} sink {config.sink_id}: marker table {in_schema_of(config.table, MARKER_TABLE)} records two "
            f"committed transactions of one batch's partition ({exc.diag.message_detail or exc}): that output was "
            "committed twice by two drivers on one checkpoint before this kit version fenced them. Remove the "
            "duplicate rows from the target and the extra marker row, then start again") from exc
    if not attempt_is_bigint(config, conn):
        _migrate_attempt(config, conn, markers)


def attempt_is_bigint(config: PostgresSinkConfig, conn: psycopg.Connection[Any]) -> bool:
    """Whether the marker table's ``attempt`` column holds Spark's 64-bit task attempt ids
    (tables made before this kit version have ``int``, which fails past 2^31). Asked once
    per process."""
    table = in_schema_of(config.table, MARKER_TABLE)
    if table not in _bigint_attempt:
        row = conn.execute("SELECT format_type(atttypid, atttypmod) FROM pg_attribute WHERE attrelid = %s::regclass "
                           "AND attname = 'attempt'", (table,)).fetchone()
        _bigint_attempt[table] = row is not None and row[0] == "bigint"
    return _bigint_attempt[table]


def _migrate_attempt(config: PostgresSinkConfig, conn: psycopg.Connection[Any], markers: sql.Composable) -> None:
    """Driver, preflight: ``attempt`` int -> bigint. The ALTER needs the table to itself, and a
    prepared transaction holds its lock until it is finished (recovery finishes this sink's
    right after the preflight; another query's may hold it any time), so it waits 3 s at
    most and is tried again at the next start; until then markers keep the attempt's low
    31 bits (the transaction id, which recovery reads, keeps all of it)."""
    table = in_schema_of(config.table, MARKER_TABLE)
    try:
        with conn.transaction():
            conn.execute("SET LOCAL lock_timeout = '3s'")
            conn.execute(sql.SQL("ALTER TABLE {} ALTER COLUMN attempt TYPE bigint").format(markers))
        _bigint_attempt[table] = True
        logger.warning("sink %s: marker table %s migrated: attempt is bigint", config.sink_id, table)
    except psycopg.errors.LockNotAvailable:
        logger.warning("sink %s: marker table %s has attempt int (fails past 2^31 task attempts); its migration "
                       "to bigint waits for prepared transactions to finish and is tried at the next start",
                       config.sink_id, table)


def _digest(*parts: str) -> str:
    return hashlib.sha1("\0".join(parts).encode()).hexdigest()[:16]


def _create_staging(config: PostgresSinkConfig, conn: psycopg.Connection[Any], kind: sql.Composable,
                    name: sql.Composable) -> None:
    # LIKE copies NOT NULL, so COPY into the staging table already names a refused row.
    conn.execute(sql.SQL("CREATE {} TABLE IF NOT EXISTS {} (LIKE {} INCLUDING DEFAULTS, {} bigint)").format(
        kind, name, identifier(config.table), sql.Identifier(ORDINAL)))


def temporary_staging(config: PostgresSinkConfig, conn: psycopg.Connection[Any]) -> sql.Composable | None:
    """The staging table of the task-commit protocols and the write-ahead log, when the sink
    merges: temporary, made on ``conn`` (autocommit, outside any transaction) the first time
    this session needs it."""
    if not config.key_columns:
        return None
    name = "oncekit_stage_" + _digest(config.table)
    made = _temporary_tables.setdefault(conn, set())
    if name not in made:
        _create_staging(config, conn, sql.SQL("TEMPORARY"), sql.Identifier(name))
        made.add(name)
    return sql.Identifier("pg_temp", name)


def unlogged_staging(config: PostgresSinkConfig, conn: psycopg.Connection[Any], task: TaskInfo) -> sql.Composable | None:
    """Two-phase commit's staging table for ``task``'s partition, made (outside any
    transaction, on ``conn`` in autocommit mode) the first time this process needs it."""
    if not config.key_columns:
        return None
    name = _unlogged_name(config, task)
    if (config.dsn, name) not in _unlogged_tables:
        try:
            _create_staging(config, conn, sql.SQL("UNLOGGED"), identifier(name))
        except (psycopg.errors.UniqueViolation, psycopg.errors.DuplicateTable):
            pass  # another attempt of the partition made it at the same moment
        _unlogged_tables.add((config.dsn, name))
    return identifier(name)


def forget_unlogged_staging(config: PostgresSinkConfig, task: TaskInfo) -> None:
    """After a failed task: check the staging table again next time (someone may have dropped it)."""
    _unlogged_tables.discard((config.dsn, _unlogged_name(config, task)))


def _unlogged_name(config: PostgresSinkConfig, task: TaskInfo) -> str:
    digest = _digest(config.sink_id, config.table, *config.columns)
    return in_schema_of(config.table, f"oncekit_stage_{digest}_{task.partition_id}")

"""What the PostgreSQL sinks' protocols share: pooled connections, preflight of the target, the
partition writer (Arrow batches streamed as CSV through one COPY; a merge by key through a
staging table when the target already holds a key), and the names of the kit's own tables.

Staging tables (only where ``key_columns`` are declared) are made once and reused:

- temporary ``oncekit_stage_<digest>`` per pooled connection and target, for the protocols that
  commit in the task or on the driver (idempotent, at-least-once, write-ahead log);
- unlogged ``oncekit_stage_<digest>_<partition>`` in the target's schema per (sink, stream
  columns, partition), for two-phase commit (PostgreSQL cannot PREPARE a transaction that
  touched a temporary table). The transaction empties it with TRUNCATE, so it never holds dead
  rows; concurrent attempts of one partition wait for each other there (a deadlock between them
  fails one attempt, which Spark retries). They hold no data between transactions and may be
  dropped whenever no query runs.

Never row-by-row INSERT: a refused row fails the batch with an error naming sink, batch,
partition, row and column, or, with a dead-letter table, goes there with the server's error text.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import weakref
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np
import psycopg
import pyarrow as pa
from psycopg import sql

from oncekit.connectors.postgres import check_server
from oncekit.connectors.redact import redact_dsn
from oncekit.core.errors import BadRecordError, ConfigError, FencedError, OncekitError, ServiceError
from oncekit.core.protocol import Sink, SinkOwner, TaskInfo
from oncekit.sinks.postgres._csv import csv_for_copy
from oncekit.sinks.postgres._pool import LOCK_TIMEOUT_S, POOL

if TYPE_CHECKING:
    from oncekit.sinks.postgres.config import PostgresSinkConfig

logger = logging.getLogger(__name__)

FORMAT = "oncekit-postgres"
MARKER_TABLE = "oncekit_markers"
CHECKPOINT_TABLE = "oncekit_checkpoints"
OWNER_TABLE = "oncekit_sinks"
"""Per sink id, the query (id and checkpoint) that writes through it (:meth:`Sink.claim`), and the
epoch of its newest run (:meth:`PostgresSinkBase.take_epoch`): the fencing token that the
committing transactions check."""
ORDINAL = "oncekit_row"
"""The staging tables' extra column: a row's position in its COPY, which orders repeated keys."""

SEGMENT_BYTES = 64 << 20
"""For a sink that merges or has a dead-letter table, the Arrow bytes one COPY carries at most:
a refused segment is written again from memory, so this bounds what the writer keeps."""

_SAVEPOINT = "oncekit_rows"
_REFUSED = (psycopg.errors.DataError, psycopg.errors.IntegrityError)

# Temporary staging tables each pooled connection has made (they live as long as its session).
_temporary_tables: weakref.WeakKeyDictionary[psycopg.Connection[Any], set[str]] = weakref.WeakKeyDictionary()
# Unlogged staging tables this process has made, by connection string.
_unlogged_tables: set[tuple[str, str]] = set()


def identifier(name: str) -> sql.Identifier:
    """``schema.table`` or ``table`` as a quoted identifier."""
    return sql.Identifier(*name.split(".", 1))


def in_schema_of(table: str, other: str) -> str:
    """``other`` in the same schema as ``table``."""
    return f"{table.split('.', 1)[0]}.{other}" if "." in table else other


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


DDL_LOCK = "oncekit-ddl"
"""The advisory lock's name (hashed to its key) that :func:`kit_ddl` holds."""


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


def _digest(*parts: str) -> str:
    return hashlib.sha1("\0".join(parts).encode()).hexdigest()[:16]


class TableWriter:
    """Streams one partition's Arrow batches into the target inside the caller's open transaction.

    Task or driver: ``write`` each batch, then ``finish``. Batches stream through one COPY
    straight into the target, so the server parses rows while the next batch is rendered. A sink
    that merges by key, or has a dead-letter table, COPYs per segment of at most SEGMENT_BYTES
    under a savepoint and keeps the segment's batches until it is in. A merging segment the
    target refuses for a duplicate key (a key the target holds, or one the segment repeats) is
    rolled back and merged instead: COPY into the staging table with each row's ordinal, one
    INSERT ... SELECT ... ON CONFLICT, TRUNCATE the staging table. When the segment repeats a key
    (found in Arrow), DISTINCT ON keeps one row of it, since ON CONFLICT cannot touch a row twice
    in one statement: the last for ``on_conflict="update"``, the first for ``"nothing"``, as
    across batches. A segment still refused fails the batch with BadRecordError or, with a
    dead-letter table, is retried batch by batch and a refused batch row by row, so only the
    refused rows go there.
    """

    def __init__(self, sink: PostgresSinkBase, conn: psycopg.Connection[Any], task: TaskInfo,
                 staging: sql.Composable | None) -> None:
        self.sink, self.conn, self.task, self.staging = sink, conn, task, staging
        self.config = sink.config
        self.rows = 0
        self._guarded = bool(self.config.key_columns or self.config.dead_letter_table)
        self._stack = ExitStack()
        self._copy: psycopg.Copy | None = None
        self._names: list[str] = []
        self._segment: list[pa.RecordBatch] = []
        self._segment_rows = 0
        self._segment_bytes = 0

    def write(self, batch: pa.RecordBatch) -> None:
        """Send one batch; a refusal surfaces at the end of its segment."""
        if batch.num_rows == 0:
            return
        with self._named_errors():
            if self._copy is None:
                self._names = batch.schema.names
                self._copy = self._open(staged=False)
            self._send(self._copy, batch, None)
        self._segment_rows += batch.num_rows
        if self._guarded:
            self._segment.append(batch)
            self._segment_bytes += batch.nbytes
            if self._segment_bytes >= SEGMENT_BYTES:
                self._close_segment()

    def finish(self) -> int:
        """End the COPY (and any merge); return the partition's rows."""
        if self._copy is not None:
            self._close_segment()
        return self.rows

    def _open(self, staged: bool) -> psycopg.Copy:
        """Start a COPY into the target, or into the staging table with the ordinal column."""
        if self._guarded:
            self.conn.execute(f"SAVEPOINT {_SAVEPOINT}")
        into, columns = (self.staging, [*self._names, ORDINAL]) if staged else (identifier(self.config.table), self._names)
        statement = sql.SQL("COPY {} ({}) FROM STDIN (FORMAT csv)").format(
            into, sql.SQL(", ").join(map(sql.Identifier, columns)))
        return self._stack.enter_context(self._stack.enter_context(self.conn.cursor()).copy(statement))

    def _send(self, copy: psycopg.Copy, batch: pa.RecordBatch, ordinal: int | None) -> None:
        if ordinal is not None:
            batch = batch.append_column(ORDINAL, pa.array(np.arange(ordinal, ordinal + batch.num_rows)))
        copy.write(memoryview(csv_for_copy(batch)))

    def _end(self) -> None:
        """End the COPY: where the server reports a refused row."""
        self._copy = None
        self._stack.close()

    def _close_segment(self) -> None:
        segment, rows = self._segment, self._segment_rows
        self._segment, self._segment_rows, self._segment_bytes = [], 0, 0
        with self._named_errors():
            try:
                self._end()
            except _REFUSED as exc:
                if not self._guarded:
                    raise self._bad_record(exc) from exc
                self._roll_back()
                refusal = self._attempt(segment) if self._merges_after(exc) else exc
                if refusal is not None:
                    if not self.config.dead_letter_table:
                        raise self._bad_record(refusal) from refusal
                    self._salvage(segment)
            else:
                if self._guarded:
                    self.conn.execute(f"RELEASE SAVEPOINT {_SAVEPOINT}")
        self.rows += rows

    def _merges_after(self, exc: psycopg.Error) -> bool:
        """Whether a merge may take what a straight COPY refused: a duplicate key, not a bad row."""
        return self.staging is not None and isinstance(exc, psycopg.errors.UniqueViolation)

    def _attempt(self, batches: list[pa.RecordBatch]) -> psycopg.Error | None:
        """Write ``batches`` under a savepoint (merged when the sink merges); the server's
        refusal, rolled back, or None."""
        staged = self.staging is not None
        copy = self._open(staged)
        try:
            ordinal = 0
            for batch in batches:
                self._send(copy, batch, ordinal if staged else None)
                ordinal += batch.num_rows
            self._end()
            if staged:
                self._merge(batches)
        except _REFUSED as exc:
            self._roll_back()
            return exc
        self.conn.execute(f"RELEASE SAVEPOINT {_SAVEPOINT}")
        return None

    def _merge(self, batches: list[pa.RecordBatch]) -> None:
        keys = pa.Table.from_batches([batch.select(list(self.config.key_columns)) for batch in batches])
        repeated = keys.group_by(keys.column_names).aggregate([]).num_rows < keys.num_rows
        key_list = sql.SQL(", ").join(map(sql.Identifier, self.config.key_columns))
        columns = sql.SQL(", ").join(map(sql.Identifier, self._names))
        updates = [c for c in self._names if c not in self.config.key_columns]
        action: sql.Composable = sql.SQL("DO NOTHING")
        if self.config.on_conflict == "update" and updates:
            action = sql.SQL("DO UPDATE SET {}").format(
                sql.SQL(", ").join(sql.SQL("{0} = EXCLUDED.{0}").format(sql.Identifier(c)) for c in updates))
        distinct: sql.Composable = sql.SQL("")
        order: sql.Composable = sql.SQL("")
        if repeated:
            distinct = sql.SQL("DISTINCT ON ({}) ").format(key_list)
            order = sql.SQL(" ORDER BY {}, {} {}").format(
                key_list, sql.Identifier(ORDINAL), sql.SQL("DESC" if self.config.on_conflict == "update" else "ASC"))
        self.conn.execute(sql.SQL(
            "INSERT INTO {target} ({columns}) SELECT {distinct}{columns} FROM {staging}{order} ON CONFLICT ({keys}) {action}"
        ).format(target=identifier(self.config.table), columns=columns, distinct=distinct, staging=self.staging,
                 order=order, keys=key_list, action=action))
        self.conn.execute(sql.SQL("TRUNCATE {}").format(self.staging))

    def _roll_back(self) -> None:
        self.conn.execute(f"ROLLBACK TO SAVEPOINT {_SAVEPOINT}; RELEASE SAVEPOINT {_SAVEPOINT}")

    def _salvage(self, segment: list[pa.RecordBatch]) -> None:
        """A refused segment again, batch by batch, then a refused batch row by row; refused rows
        go to the dead-letter table with the server's error."""
        dead = identifier(self.config.dead_letter_table or "")
        refused, offset = 0, self.rows
        for batch in segment:
            if self._attempt([batch]) is not None:
                for index in range(batch.num_rows):
                    row = batch.slice(index, 1)
                    exc = self._attempt([row])
                    if exc is None:
                        continue
                    refused += 1
                    record = json.dumps(row.to_pylist()[0], default=lambda v: v.hex() if isinstance(v, bytes) else str(v))
                    self.conn.execute(
                        sql.SQL("INSERT INTO {} (sink_id, batch_id, partition_id, row_number, record, error) "
                                "VALUES (%s, %s, %s, %s, %s, %s)").format(dead),
                        (self.task.sink_id, self.task.batch_id, self.task.partition_id, offset + index, record,
                         str(exc.diag.message_primary or exc)),
                    )
            offset += batch.num_rows
        logger.warning("sink %s batch %s partition %s: %s rows refused, sent to %s", self.task.sink_id,
                       self.task.batch_id, self.task.partition_id, refused, self.config.dead_letter_table)

    @contextmanager
    def _named_errors(self) -> Iterator[None]:
        """The server's errors that are not about one row, raised naming sink, batch, partition
        and table: a lock held too long, the target dropped or changed under the running query."""
        where = f"{FORMAT} sink {self.task.sink_id} batch {self.task.batch_id} partition {self.task.partition_id}"
        try:
            yield
        except psycopg.errors.LockNotAvailable as exc:
            raise OncekitError(
                f"{where}: waited {LOCK_TIMEOUT_S} s for rows another transaction holds: two partitions of one batch "
                "write the same key (repartition the stream by the key columns), or a lost attempt left a prepared "
                "transaction (the restart's recovery aborts it)"
            ) from exc
        except (psycopg.errors.UndefinedTable, psycopg.errors.UndefinedColumn, psycopg.errors.InsufficientPrivilege) as exc:
            raise OncekitError(
                f"{where}: table {self.config.table}: {exc.diag.message_primary or exc} (changed while the query ran?); "
                "nothing of this batch was committed: restore the table, then restart the query, which replays the batch"
            ) from exc

    def _bad_record(self, exc: Any) -> BadRecordError:
        diag = exc.diag
        line = re.search(r"line (\d+)", diag.context or "")
        named = re.search(r"column (\w+)", diag.context or "")
        column = diag.column_name or (named.group(1) if named else None)
        where = f"row {self.rows + int(line.group(1)) - 1} of the partition" if line else "a row"
        return BadRecordError(
            f"{FORMAT} sink {self.task.sink_id} batch {self.task.batch_id} partition {self.task.partition_id}: "
            f"{where}, column {column or '?'}: {diag.message_primary or exc}; nothing of this batch was committed"
        )


class PostgresSinkBase(Sink):
    """What the four protocols share: connections, preflight, staging tables. Built by
    ``PostgresSinkConfig.build`` in the driver's worker, a task, or the listener."""

    BATCH_RECORDS: str | None = None
    """The kit's table beside the target where the protocol records its committed batches
    (marker rows, recorded checkpoints), if it keeps one."""
    def __init__(self, config: PostgresSinkConfig, checkpoint: str) -> None:
        self.config, self.checkpoint = config, checkpoint
        self.sink_id = config.sink_id

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config!r})"

    def take_connection(self, autocommit: bool = False) -> psycopg.Connection[Any]:
        """A pooled connection whose statements give up after waiting LOCK_TIMEOUT_S for a lock:
        a task blocked by a prepared transaction of a lost attempt fails (and is retried, or the
        query restarts and recovery aborts that transaction) instead of waiting forever. Give it
        back with ``give_back`` or close it."""
        try:
            return POOL.take(self.config.dsn, autocommit)
        except psycopg.OperationalError as exc:
            raise OncekitError(f"{FORMAT} sink {self.sink_id}: cannot connect: {redact_dsn(str(exc)).strip()}") from exc

    def give_back(self, conn: psycopg.Connection[Any]) -> None:
        POOL.give_back(self.config.dsn, conn)

    @contextmanager
    def connection(self, autocommit: bool = False) -> Iterator[psycopg.Connection[Any]]:
        """A pooled connection for the block, closed if the block raised."""
        conn = self.take_connection(autocommit)
        try:
            yield conn
        except BaseException:
            conn.close()
            raise
        self.give_back(conn)

    def preflight(self, resumed: bool = False) -> None:
        """Driver, at query start: the target exists with the stream's columns and keys, and the
        kit's own tables exist."""
        config = self.config
        check_server(config.dsn)  # a refused password or certificate fails here by name, the DSN's password hidden
        with self.connection(autocommit=True) as conn:
            if conn.execute("SELECT to_regclass(%s)", (config.table,)).fetchone() == (None,):
                raise ConfigError(f"{FORMAT} sink {self.sink_id}: table {config.table} does not exist")
            with conn.cursor() as cur:
                cur.execute(sql.SQL("SELECT * FROM {} LIMIT 0").format(identifier(config.table)))
                existing = [d.name for d in cur.description or []]
            missing = [c for c in (*config.columns, *config.key_columns) if c not in existing]
            if missing:
                raise ConfigError(f"{FORMAT} sink {self.sink_id}: table {config.table} has no column(s) "
                                  f"{', '.join(sorted(set(missing)))}; it has {', '.join(existing)}")
            if config.key_columns:
                self._check_conflict_target(conn)
            with kit_ddl(conn):
                self._create_tables(conn)

    def recorded_owner(self) -> SinkOwner | None:
        with self.connection(autocommit=True) as conn:
            row = conn.execute(sql.SQL("SELECT query_id, checkpoint FROM {} WHERE sink_id = %s").format(
                identifier(in_schema_of(self.config.table, OWNER_TABLE))), (self.sink_id,)).fetchone()
        return None if row is None or not row[0] else SinkOwner(row[0], row[1])

    def take_epoch(self, floor: int) -> int:
        """Driver, at a run's start: raise the sink's row in ``oncekit_sinks`` to a new epoch
        above ``floor`` and above its own, atomically. The row lock waits for committing
        transactions of older runs that hold it (:meth:`check_epoch`); every later one sees
        the new epoch and is refused."""
        with self.connection(autocommit=True) as conn:
            row = conn.execute(sql.SQL(
                "INSERT INTO {table} AS s (sink_id, query_id, checkpoint, epoch) VALUES (%s, '', %s, %s) "
                "ON CONFLICT (sink_id) DO UPDATE SET epoch = GREATEST(s.epoch, EXCLUDED.epoch - 1) + 1 RETURNING epoch"
            ).format(table=identifier(in_schema_of(self.config.table, OWNER_TABLE))),
                (self.sink_id, self.checkpoint, floor + 1)).fetchone()
        assert row is not None, "INSERT ... RETURNING returns the row"
        return int(row[0])

    def check_epoch(self, conn: psycopg.Connection[Any], where: str, lock: bool) -> None:
        """Inside a transaction that decides what a batch is: FencedError (the caller's
        transaction then rolls back) when a newer run than this object's took the sink. With
        ``lock``, the sink's row is share-locked until the transaction ends, so a newer run's
        :meth:`take_epoch` waits for it: no older commit lands after the newer epoch. A prepared
        transaction cannot hold that lock (the newer run's recovery must finish it first), so a
        two-phase-commit task only reads; the marker's unique key per (sink, batch, partition)
        keeps its batch from committing twice. Unfenced (epoch 0): nothing is checked."""
        if not self.epoch:
            return
        row = conn.execute(sql.SQL("SELECT epoch FROM {} WHERE sink_id = %s{}").format(
            identifier(in_schema_of(self.config.table, OWNER_TABLE)), sql.SQL(" FOR SHARE" if lock else "")),
            (self.sink_id,)).fetchone()
        if row is not None and int(row[0]) > self.epoch:
            raise FencedError(f"{FORMAT} sink {self.sink_id} {where}: this run (epoch {self.epoch}) was superseded by "
                              f"epoch {row[0]}: another driver took the query over; nothing of this is committed")

    def record_owner(self, owner: SinkOwner) -> None:
        with self.connection(autocommit=True) as conn:
            conn.execute(sql.SQL(
                "INSERT INTO {} (sink_id, query_id, checkpoint) VALUES (%s, %s, %s) ON CONFLICT (sink_id) "
                "DO UPDATE SET query_id = EXCLUDED.query_id, checkpoint = EXCLUDED.checkpoint, claimed_at = now()"
            ).format(identifier(in_schema_of(self.config.table, OWNER_TABLE))), (self.sink_id, owner.query_id, owner.checkpoint))

    def forget(self, before_batch: int) -> None:
        """Driver, in recovery: delete this sink's rows of batches before ``before_batch`` from
        its :attr:`BATCH_RECORDS` table. They answer "committed?" only for batches recovery may
        still commit; one row per batch (and partition) would grow forever. A failure only
        delays it: the next recovery that prunes the journal deletes the same rows and newer ones."""
        try:
            self._delete_batch_records(before_batch)
        except (psycopg.Error, OncekitError) as exc:
            logger.warning("sink %s: could not delete rows of batches before %s from %s: %s", self.sink_id,
                           before_batch, self.BATCH_RECORDS, exc)

    def reset(self) -> None:
        """Driver, from ``claim``, when another query takes the sink id over: delete all of this
        sink's rows from its :attr:`BATCH_RECORDS` table."""
        try:
            self._delete_batch_records(None)
        except psycopg.Error as exc:
            raise ServiceError(f"{FORMAT} sink {self.sink_id}: cannot delete the previous query's rows from "
                               f"{self.BATCH_RECORDS}: {exc}") from exc

    def _delete_batch_records(self, before_batch: int | None) -> None:
        if self.BATCH_RECORDS is None:
            return
        below = sql.SQL("") if before_batch is None else sql.SQL(" AND batch_id < %s")
        with self.connection(autocommit=True) as conn:
            deleted = conn.execute(sql.SQL("DELETE FROM {} WHERE sink_id = %s{}").format(
                identifier(in_schema_of(self.config.table, self.BATCH_RECORDS)), below),
                (self.sink_id,) if before_batch is None else (self.sink_id, before_batch)).rowcount
        logger.info("sink %s: deleted %s rows%s from %s", self.sink_id, deleted,
                    "" if before_batch is None else f" of batches before {before_batch}", self.BATCH_RECORDS)

    def _check_conflict_target(self, conn: psycopg.Connection[Any]) -> None:

        keys = sql.SQL(", ").join(sql.Identifier(c) for c in self.config.key_columns)
        try:
            conn.execute(sql.SQL("EXPLAIN INSERT INTO {} ({}) SELECT {} FROM {} WHERE false ON CONFLICT ({}) DO NOTHING").format(
                identifier(self.config.table), keys, keys, identifier(self.config.table), keys))
        except psycopg.errors.InvalidColumnReference as exc:
            raise ConfigError(f"{FORMAT} sink {self.sink_id}: table {self.config.table} needs a unique index on "
                              f"({', '.join(self.config.key_columns)}) for key_columns") from exc

    def _create_tables(self, conn: psycopg.Connection[Any]) -> None:

        owners = in_schema_of(self.config.table, OWNER_TABLE)
        conn.execute(sql.SQL(
            "CREATE TABLE IF NOT EXISTS {} (sink_id text PRIMARY KEY, query_id text NOT NULL, checkpoint text NOT NULL, "
            "claimed_at timestamptz NOT NULL DEFAULT now(), epoch bigint NOT NULL DEFAULT 0)").format(identifier(owners)))
        add_once(conn, owners, "epoch column", "SELECT 1 FROM pg_attribute WHERE attrelid = %s::regclass AND attname = 'epoch'",
                 sql.SQL("ALTER TABLE {} ADD COLUMN IF NOT EXISTS epoch bigint NOT NULL DEFAULT 0").format(identifier(owners)))
        if self.config.dead_letter_table:
            conn.execute(sql.SQL(
                "CREATE TABLE IF NOT EXISTS {} (sink_id text NOT NULL, batch_id bigint NOT NULL, partition_id int NOT NULL, "
                "row_number bigint NOT NULL, record jsonb, error text NOT NULL, created_at timestamptz NOT NULL DEFAULT now())"
            ).format(identifier(self.config.dead_letter_table)))

    def temporary_staging(self, conn: psycopg.Connection[Any]) -> sql.Composable | None:
        """The staging table of the task-commit protocols and the write-ahead log, when the sink
        merges: temporary, made on ``conn`` (autocommit, outside any transaction) the first time
        this session needs it."""
        if not self.config.key_columns:
            return None
        name = "oncekit_stage_" + _digest(self.config.table)
        made = _temporary_tables.setdefault(conn, set())
        if name not in made:
            self._create_staging(conn, sql.SQL("TEMPORARY"), sql.Identifier(name))
            made.add(name)
        return sql.Identifier("pg_temp", name)

    def write_rows(self, conn: psycopg.Connection[Any], task: TaskInfo, batches: Iterable[pa.RecordBatch],
                   staging: sql.Composable | None) -> int:
        """Write one partition into ``conn``'s open (or next) transaction; the caller commits."""
        writer = TableWriter(self, conn, task, staging)
        for batch in batches:
            writer.write(batch)
        return writer.finish()

    def unlogged_staging(self, conn: psycopg.Connection[Any], task: TaskInfo) -> sql.Composable | None:
        """Two-phase commit's staging table for ``task``'s partition, made (outside any
        transaction, on ``conn`` in autocommit mode) the first time this process needs it."""
        if not self.config.key_columns:
            return None
        name = self._unlogged_name(task)
        if (self.config.dsn, name) not in _unlogged_tables:
            try:
                self._create_staging(conn, sql.SQL("UNLOGGED"), identifier(name))
            except (psycopg.errors.UniqueViolation, psycopg.errors.DuplicateTable):
                pass  # another attempt of the partition made it at the same moment
            _unlogged_tables.add((self.config.dsn, name))
        return identifier(name)

    def forget_unlogged_staging(self, task: TaskInfo) -> None:
        """After a failed task: check the staging table again next time (someone may have dropped it)."""
        _unlogged_tables.discard((self.config.dsn, self._unlogged_name(task)))

    def _unlogged_name(self, task: TaskInfo) -> str:
        digest = _digest(self.sink_id, self.config.table, *self.config.columns)
        return in_schema_of(self.config.table, f"oncekit_stage_{digest}_{task.partition_id}")

    def _create_staging(self, conn: psycopg.Connection[Any], kind: sql.Composable, name: sql.Composable) -> None:
        # LIKE copies NOT NULL, so COPY into the staging table already names a refused row.
        conn.execute(sql.SQL("CREATE {} TABLE IF NOT EXISTS {} (LIKE {} INCLUDING DEFAULTS, {} bigint)").format(
            kind, name, identifier(self.config.table), sql.Identifier(ORDINAL)))

    def write_and_commit(self, task: TaskInfo, batches: Iterator[pa.RecordBatch]) -> int:
        """Task: write the partition in one transaction of its own and commit it."""
        with self.connection(autocommit=True) as conn:
            staging = self.temporary_staging(conn)
            conn.autocommit = False
            rows = self.write_rows(conn, task, batches, staging)
            conn.commit()
        logger.info("sink %s batch %s partition %s: wrote and committed %s rows", self.sink_id, task.batch_id,
                    task.partition_id, rows)
        return rows

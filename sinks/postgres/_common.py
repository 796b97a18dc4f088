"""What the PostgreSQL sinks' protocols share: connections with a lock timeout, preflight of the
target, Arrow batches rendered to CSV and written with COPY (merged by key through a staging
table), and the names of the kit's own tables.

Never row-by-row INSERT: a refused row fails the batch with an error naming sink, batch,
partition, row and column, or, with a dead-letter table, goes there with the server's error text.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import psycopg
import pyarrow as pa
import pyarrow.csv as pacsv
from psycopg import sql

from oncekit.connectors.postgres import connect
from oncekit.connectors.redact import redact_dsn
from oncekit.core.errors import BadRecordError, ConfigError, OncekitError
from oncekit.core.protocol import Sink, TaskInfo

if TYPE_CHECKING:
    from oncekit.sinks.postgres.config import PostgresSinkConfig

logger = logging.getLogger(__name__)

FORMAT = "oncekit-postgres"
MARKER_TABLE = "oncekit_markers"
CHECKPOINT_TABLE = "oncekit_checkpoints"
LOCK_TIMEOUT_S = 60


def identifier(name: str) -> sql.Identifier:
    """``schema.table`` or ``table`` as a quoted identifier."""
    return sql.Identifier(*name.split(".", 1))


def in_schema_of(table: str, other: str) -> str:
    """``other`` in the same schema as ``table``."""
    return f"{table.split('.', 1)[0]}.{other}" if "." in table else other


def csv_for_copy(batch: pa.RecordBatch) -> bytes:
    """One Arrow batch as CSV for COPY: NULL is an unquoted empty field, text is always quoted,
    bytes are rendered as bytea hex."""
    columns = []
    for column in batch.columns:
        if pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type):
            column = pa.array([None if v is None else "\\x" + v.hex() for v in column.to_pylist()], pa.string())
        elif pa.types.is_nested(column.type):
            column = pa.array([None if v is None else json.dumps(v, default=str) for v in column.to_pylist()], pa.string())
        columns.append(column)
    out = io.BytesIO()
    pacsv.write_csv(pa.RecordBatch.from_arrays(columns, names=batch.schema.names), out,
                    pacsv.WriteOptions(include_header=False))
    return out.getvalue()


class TableWriter:
    """Writes Arrow batches into the target inside the caller's open transaction.

    Appends COPY straight into the target; merges COPY into a staging table and run one
    INSERT ... SELECT ... ON CONFLICT per Arrow batch. A refused row either raises
    BadRecordError or, with a dead-letter table, is retried row by row under savepoints so that
    only the refused rows go to the dead-letter table.
    """

    def __init__(self, sink: PostgresSinkBase, conn: psycopg.Connection[Any], task: TaskInfo, staging: str | None) -> None:
        self.sink, self.conn, self.task, self.staging = sink, conn, task, staging
        self.rows = 0

    def write(self, batch: pa.RecordBatch) -> None:

        if batch.num_rows == 0:
            return
        try:
            with self.conn.transaction():  # a savepoint: a refused batch leaves the transaction usable
                self._apply(batch)
        except psycopg.errors.LockNotAvailable as exc:
            raise OncekitError(
                f"{FORMAT} sink {self.task.sink_id} batch {self.task.batch_id} partition {self.task.partition_id}: "
                f"waited {LOCK_TIMEOUT_S} s for rows another transaction holds: two partitions of one batch write "
                "the same key (repartition the stream by the key columns), or a lost attempt left a prepared "
                "transaction (the restart's recovery aborts it)"
            ) from exc
        except (psycopg.errors.DataError, psycopg.errors.IntegrityError) as exc:
            if self.sink.config.dead_letter_table is None:
                raise self._bad_record(exc, batch) from exc
            self._write_row_by_row(batch)
        self.rows += batch.num_rows

    def _apply(self, batch: pa.RecordBatch) -> None:

        config = self.sink.config
        names = batch.schema.names
        columns = sql.SQL(", ").join(sql.Identifier(c) for c in names)
        target = identifier(config.table)
        into = sql.Identifier(self.staging) if self.staging else target
        with self.conn.cursor() as cur:
            with cur.copy(sql.SQL("COPY {} ({}) FROM STDIN (FORMAT csv)").format(into, columns)) as copy:
                copy.write(csv_for_copy(batch))
            if self.staging is None:
                return
            keys = sql.SQL(", ").join(sql.Identifier(c) for c in config.key_columns)
            action: sql.Composable
            if config.on_conflict == "nothing":
                action = sql.SQL("DO NOTHING")
            else:
                updates = [c for c in names if c not in config.key_columns]
                action = sql.SQL("DO UPDATE SET {}").format(
                    sql.SQL(", ").join(sql.SQL("{0} = EXCLUDED.{0}").format(sql.Identifier(c)) for c in updates)
                ) if updates else sql.SQL("DO NOTHING")
            # DISTINCT ON keeps one row per key (ON CONFLICT cannot touch a row twice in one
            # statement); ordering by ctid DESC makes it the batch's last row for that key.
            cur.execute(sql.SQL(
                "INSERT INTO {target} ({columns}) SELECT DISTINCT ON ({keys}) {columns} FROM {staging} "
                "ORDER BY {keys}, ctid DESC ON CONFLICT ({keys}) {action}"
            ).format(target=target, columns=columns, keys=keys, staging=sql.Identifier(self.staging), action=action))
            cur.execute(sql.SQL("DELETE FROM {}").format(sql.Identifier(self.staging)))

    def _write_row_by_row(self, batch: pa.RecordBatch) -> None:

        dead = identifier(self.sink.config.dead_letter_table or "")
        refused = 0
        for index in range(batch.num_rows):
            row = batch.slice(index, 1)
            try:
                with self.conn.transaction():
                    self._apply(row)
            except (psycopg.errors.DataError, psycopg.errors.IntegrityError) as exc:
                refused += 1
                record = json.dumps(row.to_pylist()[0], default=lambda v: v.hex() if isinstance(v, bytes) else str(v))
                self.conn.execute(
                    sql.SQL("INSERT INTO {} (sink_id, batch_id, partition_id, row_number, record, error) "
                            "VALUES (%s, %s, %s, %s, %s, %s)").format(dead),
                    (self.task.sink_id, self.task.batch_id, self.task.partition_id, self.rows + index, record,
                     str(exc.diag.message_primary or exc)),
                )
        logger.warning("sink %s batch %s partition %s: %s rows refused, sent to %s", self.task.sink_id,
                       self.task.batch_id, self.task.partition_id, refused, self.sink.config.dead_letter_table)

    def _bad_record(self, exc: Any, batch: pa.RecordBatch) -> BadRecordError:
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
    """What the four protocols share: connections, preflight, the staging table. Built by
    ``PostgresSinkConfig.build`` in the driver's worker, a task, or the listener."""
    def __init__(self, config: PostgresSinkConfig, checkpoint: str) -> None:
        self.config, self.checkpoint = config, checkpoint
        self.sink_id = config.sink_id

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config!r})"

    def connect(self, autocommit: bool = False) -> psycopg.Connection[Any]:
        """A connection whose statements give up after waiting LOCK_TIMEOUT for a lock: a task
        blocked by a prepared transaction of a lost attempt fails (and is retried, or the query
        restarts and recovery aborts that transaction) instead of waiting forever."""
        try:
            conn = connect(self.config.dsn, autocommit=autocommit)
        except psycopg.OperationalError as exc:
            raise OncekitError(f"{FORMAT} sink {self.sink_id}: cannot connect: {redact_dsn(str(exc)).strip()}") from exc
        conn.execute(f"SET lock_timeout = '{LOCK_TIMEOUT_S}s'")
        if not autocommit:
            conn.commit()
        return conn

    def preflight(self) -> None:
        """Driver, at query start: the target exists with the stream's columns and keys, and the
        kit's own tables exist."""
        config = self.config
        with self.connect(autocommit=True) as conn:
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
            self._create_tables(conn)

    def _check_conflict_target(self, conn: psycopg.Connection[Any]) -> None:

        keys = sql.SQL(", ").join(sql.Identifier(c) for c in self.config.key_columns)
        try:
            conn.execute(sql.SQL("EXPLAIN INSERT INTO {} ({}) SELECT {} FROM {} WHERE false ON CONFLICT ({}) DO NOTHING").format(
                identifier(self.config.table), keys, keys, identifier(self.config.table), keys))
        except psycopg.errors.InvalidColumnReference as exc:
            raise ConfigError(f"{FORMAT} sink {self.sink_id}: table {self.config.table} needs a unique index on "
                              f"({', '.join(self.config.key_columns)}) for key_columns") from exc

    def _create_tables(self, conn: psycopg.Connection[Any]) -> None:

        if self.config.dead_letter_table:
            conn.execute(sql.SQL(
                "CREATE TABLE IF NOT EXISTS {} (sink_id text NOT NULL, batch_id bigint NOT NULL, partition_id int NOT NULL, "
                "row_number bigint NOT NULL, record jsonb, error text NOT NULL, created_at timestamptz NOT NULL DEFAULT now())"
            ).format(identifier(self.config.dead_letter_table)))

    def write_and_commit(self, task: TaskInfo, batches: Iterator[pa.RecordBatch]) -> int:
        """Task: write the partition in one transaction of its own and commit it."""
        with self.connect() as conn:
            staging = self.staging_table(task)
            if staging:
                self.create_staging(conn, staging, temporary=True)
            writer = TableWriter(self, conn, task, staging)
            for batch in batches:
                writer.write(batch)
            conn.commit()
        logger.info("sink %s batch %s partition %s: wrote and committed %s rows", self.sink_id, task.batch_id,
                    task.partition_id, writer.rows)
        return writer.rows

    def staging_table(self, task: TaskInfo) -> str | None:
        """A staging table name unique to the transaction, when the sink merges by key."""
        if not self.config.key_columns:
            return None
        return "oncekit_stage_" + hashlib.sha1(task.transaction_id.encode()).hexdigest()[:20]

    def create_staging(self, conn: psycopg.Connection[Any], name: str, temporary: bool) -> None:

        kind = sql.SQL("TEMPORARY TABLE") if temporary else sql.SQL("UNLOGGED TABLE")
        suffix = sql.SQL(" ON COMMIT DROP") if temporary else sql.SQL("")
        conn.execute(sql.SQL("CREATE {} {} (LIKE {} INCLUDING DEFAULTS){}").format(
            kind, sql.Identifier(name), identifier(self.config.table), suffix))


"""PostgreSQL sinks (psycopg 3): two-phase commit, write-ahead log, idempotent, at-least-once.

Every protocol writes with COPY (Arrow batches rendered to CSV in C by pyarrow), and merges by
key through a staging table where keys are declared; never row-by-row INSERT. A row the target
refuses fails the batch with an error that names the sink, batch, partition, row and column,
or, with ``dead_letter_table``, goes there with the server's error text while the rest commits.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from oncekit.connectors.base import redact_dsn
from oncekit.connectors.postgres import connect
from oncekit.core.base import (
    CommitError,
    CommitOutcome,
    Committable,
    DeliveryGuarantee,
    IdempotentSink,
    Sink,
    TaskInfo,
    TwoPhaseCommitSink,
    WriteAheadSink,
)
from oncekit.core.errors import ConfigError, OncekitError
from oncekit.core.staging import StagedFiles
from oncekit.sinks.base import SinkConfig

if TYPE_CHECKING:
    import psycopg
    import pyarrow as pa
    from psycopg import sql

logger = logging.getLogger(__name__)

FORMAT = "oncekit-postgres"
PROTOCOLS = ("two-phase-commit", "write-ahead-log", "idempotent", "at-least-once")
MARKER_TABLE = "oncekit_markers"
CHECKPOINT_TABLE = "oncekit_checkpoints"
LOCK_TIMEOUT_S = 60


class BadRecordError(OncekitError):
    """The target refused a row; the message names sink, batch, partition, row and column."""


@dataclass(frozen=True)
class PostgresSinkConfig(SinkConfig):
    """A PostgreSQL sink. ``protocol`` picks the commit protocol:

    - ``two-phase-commit``: tasks PREPARE a transaction per partition; the driver COMMITs PREPARED
      once the checkpoint completes. Needs ``max_prepared_transactions`` > 0 on the server.
    - ``write-ahead-log``: tasks stage rows under the checkpoint; once it completes, one
      transaction writes them and records (sink, batch) in ``oncekit_checkpoints``.
    - ``idempotent``: tasks upsert by ``key_columns`` and commit at once.
    - ``at-least-once``: tasks append and commit at once; a replay duplicates rows.

    ``key_columns`` turn appends into merges: ``on_conflict="update"`` (upsert; the last row of
    a batch wins for a key) or ``"nothing"`` (append with a dedup key).
    """

    format_name: ClassVar[str] = FORMAT

    dsn: str = field(repr=False)
    table: str
    protocol: str = "two-phase-commit"
    sink_id: str = ""
    key_columns: tuple[str, ...] = ()
    on_conflict: str = "update"
    dead_letter_table: str | None = None
    columns: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self._check_common(self.protocol, PROTOCOLS, self.table, f"pg-{self.table}")
        if self.on_conflict not in ("update", "nothing"):
            raise ConfigError(f"{FORMAT}: on_conflict must be 'update' or 'nothing', got {self.on_conflict!r}")
        if self.protocol == "idempotent" and not self.key_columns:
            raise ConfigError(f"{FORMAT} sink {self.sink_id}: the idempotent protocol needs key_columns")

    def __repr__(self) -> str:
        return (f"PostgresSinkConfig(dsn={redact_dsn(self.dsn)!r}, table={self.table!r}, protocol={self.protocol!r}, "
                f"sink_id={self.sink_id!r}, key_columns={self.key_columns!r})")

    @property
    def guarantee(self) -> DeliveryGuarantee:
        return DeliveryGuarantee.AT_LEAST_ONCE if self.protocol == "at-least-once" else DeliveryGuarantee.EXACTLY_ONCE

    def to_options(self) -> dict[str, str]:
        options = {"dsn": self.dsn, "table": self.table, "protocol": self.protocol, "sinkid": self.sink_id,
                   "keycolumns": ",".join(self.key_columns), "onconflict": self.on_conflict}
        if self.dead_letter_table:
            options["deadlettertable"] = self.dead_letter_table
        return options

    @classmethod
    def from_options(cls, options: Mapping[str, str], columns: tuple[str, ...]) -> PostgresSinkConfig:
        get = {k.lower(): v for k, v in options.items()}.get
        if not get("dsn"):
            raise ConfigError(f"{FORMAT}: option dsn is required (a psycopg connection string)")
        return cls(
            dsn=get("dsn", ""),
            table=get("table", ""),
            protocol=get("protocol", "two-phase-commit"),
            sink_id=get("sinkid", ""),
            key_columns=tuple(c.strip() for c in get("keycolumns", "").split(",") if c.strip()),
            on_conflict=get("onconflict", "update"),
            dead_letter_table=get("deadlettertable") or None,
            columns=columns,
        )

    def build(self, checkpoint: str) -> Sink:
        sink_type: Callable[[PostgresSinkConfig, str], Sink] = {
            "two-phase-commit": PostgresTwoPhaseCommitSink,
            "write-ahead-log": PostgresWriteAheadSink,
            "idempotent": PostgresIdempotentSink,
            "at-least-once": PostgresAtLeastOnceSink,
        }[self.protocol]
        return sink_type(self, checkpoint)


def _identifier(name: str) -> sql.Identifier:
    """``schema.table`` or ``table`` as a quoted identifier."""
    from psycopg import sql

    return sql.Identifier(*name.split(".", 1))


def _with_table(table: str, other: str) -> str:
    """``other`` in the same schema as ``table``."""
    return f"{table.split('.', 1)[0]}.{other}" if "." in table else other


def _csv(batch: pa.RecordBatch) -> bytes:
    """One Arrow batch as CSV for COPY: NULL is an unquoted empty field, text is always quoted,
    bytes are rendered as bytea hex."""
    import pyarrow as pa
    import pyarrow.csv as pacsv

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


class _TableWriter:
    """Writes Arrow batches into the target inside the caller's open transaction.

    Appends COPY straight into the target; merges COPY into a staging table and run one
    INSERT ... SELECT ... ON CONFLICT per Arrow batch. A refused row either raises
    BadRecordError or, with a dead-letter table, is retried row by row under savepoints so that
    only the refused rows go to the dead-letter table.
    """

    def __init__(self, sink: _PostgresSink, conn: psycopg.Connection[Any], task: TaskInfo, staging: str | None) -> None:
        self.sink, self.conn, self.task, self.staging = sink, conn, task, staging
        self.rows = 0

    def write(self, batch: pa.RecordBatch) -> None:
        import psycopg

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
        from psycopg import sql

        config = self.sink.config
        names = batch.schema.names
        columns = sql.SQL(", ").join(sql.Identifier(c) for c in names)
        target = _identifier(config.table)
        into = sql.Identifier(self.staging) if self.staging else target
        with self.conn.cursor() as cur:
            with cur.copy(sql.SQL("COPY {} ({}) FROM STDIN (FORMAT csv)").format(into, columns)) as copy:
                copy.write(_csv(batch))
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
        import psycopg
        from psycopg import sql

        dead = _identifier(self.sink.config.dead_letter_table or "")
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


class _PostgresSink(Sink):
    """What the four protocols share: connections, preflight, the staging table."""

    def __init__(self, config: PostgresSinkConfig, checkpoint: str) -> None:
        self.config, self.checkpoint = config, checkpoint
        self.sink_id = config.sink_id
        self.guarantee = config.guarantee

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config!r})"

    def connect(self, autocommit: bool = False) -> psycopg.Connection[Any]:
        """A connection whose statements give up after waiting LOCK_TIMEOUT for a lock: a task
        blocked by a prepared transaction of a lost attempt fails (and is retried, or the query
        restarts and recovery aborts that transaction) instead of waiting forever."""
        import psycopg

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
        from psycopg import sql

        config = self.config
        with self.connect(autocommit=True) as conn:
            if conn.execute("SELECT to_regclass(%s)", (config.table,)).fetchone() == (None,):
                raise ConfigError(f"{FORMAT} sink {self.sink_id}: table {config.table} does not exist")
            with conn.cursor() as cur:
                cur.execute(sql.SQL("SELECT * FROM {} LIMIT 0").format(_identifier(config.table)))
                existing = [d.name for d in cur.description or []]
            missing = [c for c in (*config.columns, *config.key_columns) if c not in existing]
            if missing:
                raise ConfigError(f"{FORMAT} sink {self.sink_id}: table {config.table} has no column(s) "
                                  f"{', '.join(sorted(set(missing)))}; it has {', '.join(existing)}")
            if config.key_columns:
                self._check_conflict_target(conn)
            self._create_tables(conn)

    def _check_conflict_target(self, conn: psycopg.Connection[Any]) -> None:
        import psycopg
        from psycopg import sql

        keys = sql.SQL(", ").join(sql.Identifier(c) for c in self.config.key_columns)
        try:
            conn.execute(sql.SQL("EXPLAIN INSERT INTO {} ({}) SELECT {} FROM {} WHERE false ON CONFLICT ({}) DO NOTHING").format(
                _identifier(self.config.table), keys, keys, _identifier(self.config.table), keys))
        except psycopg.errors.InvalidColumnReference as exc:
            raise ConfigError(f"{FORMAT} sink {self.sink_id}: table {self.config.table} needs a unique index on "
                              f"({', '.join(self.config.key_columns)}) for key_columns") from exc

    def _create_tables(self, conn: psycopg.Connection[Any]) -> None:
        from psycopg import sql

        if self.config.dead_letter_table:
            conn.execute(sql.SQL(
                "CREATE TABLE IF NOT EXISTS {} (sink_id text NOT NULL, batch_id bigint NOT NULL, partition_id int NOT NULL, "
                "row_number bigint NOT NULL, record jsonb, error text NOT NULL, created_at timestamptz NOT NULL DEFAULT now())"
            ).format(_identifier(self.config.dead_letter_table)))

    def write_and_commit(self, task: TaskInfo, batches: Iterator[pa.RecordBatch]) -> int:
        """Task: write the partition in one transaction of its own and commit it."""
        with self.connect() as conn:
            staging = self.staging_table(task)
            if staging:
                self.create_staging(conn, staging, temporary=True)
            writer = _TableWriter(self, conn, task, staging)
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
        from psycopg import sql

        kind = sql.SQL("TEMPORARY TABLE") if temporary else sql.SQL("UNLOGGED TABLE")
        suffix = sql.SQL(" ON COMMIT DROP") if temporary else sql.SQL("")
        conn.execute(sql.SQL("CREATE {} {} (LIKE {} INCLUDING DEFAULTS){}").format(
            kind, sql.Identifier(name), _identifier(self.config.table), suffix))


class PostgresTwoPhaseCommitSink(_PostgresSink, TwoPhaseCommitSink["_PreparedTransaction"]):
    """Tasks prepare, the driver commits prepared. A marker row in each prepared transaction tells
    "committed" from "rolled back" once the id has left ``pg_prepared_xacts``."""

    def preflight(self) -> None:
        with self.connect(autocommit=True) as conn:
            row = conn.execute("SHOW max_prepared_transactions").fetchone()
            if row is None or int(row[0]) == 0:
                raise ConfigError(f"{FORMAT} sink {self.sink_id}: the server has max_prepared_transactions = 0; "
                                  "set it above the number of partitions times two (postgres -c max_prepared_transactions=64) and restart it")
        super().preflight()

    def _create_tables(self, conn: psycopg.Connection[Any]) -> None:
        from psycopg import sql

        super()._create_tables(conn)
        conn.execute(sql.SQL(
            "CREATE TABLE IF NOT EXISTS {} (transaction_id text PRIMARY KEY, sink_id text NOT NULL, batch_id bigint NOT NULL, "
            "partition_id int NOT NULL, attempt int NOT NULL, rows bigint NOT NULL, prepared_at timestamptz NOT NULL DEFAULT now())"
        ).format(_identifier(_with_table(self.config.table, MARKER_TABLE))))

    def begin_transaction(self, task: TaskInfo) -> _PreparedTransaction:
        conn = self.connect(autocommit=True)
        stale = [c for c in self.leftovers([task.batch_id], conn) if c.partition_id == task.partition_id]
        for committable in stale:  # an earlier attempt or run; Spark re-runs the batch, so it never completed
            logger.info("sink %s batch %s partition %s txn %s: aborting stale attempt", self.sink_id,
                        task.batch_id, task.partition_id, committable.transaction_id)
            self._rollback_prepared(conn, committable.transaction_id)
        conn.autocommit = False
        conn.tpc_begin(task.transaction_id)
        staging = self.staging_table(task)
        if staging:
            self.create_staging(conn, staging, temporary=False)  # PREPARE refuses temporary tables
        logger.info("sink %s batch %s partition %s txn %s: begin", self.sink_id, task.batch_id, task.partition_id,
                    task.transaction_id)
        return _PreparedTransaction(task, conn, _TableWriter(self, conn, task, staging))

    def write(self, transaction: _PreparedTransaction, batch: pa.RecordBatch) -> None:
        transaction.writer.write(batch)

    def pre_commit(self, transaction: _PreparedTransaction) -> Committable:
        from psycopg import sql

        task, conn = transaction.task, transaction.conn
        if transaction.writer.staging:
            conn.execute(sql.SQL("DROP TABLE {}").format(sql.Identifier(transaction.writer.staging)))
        rows = transaction.writer.rows
        conn.execute(
            sql.SQL("INSERT INTO {} (transaction_id, sink_id, batch_id, partition_id, attempt, rows) "
                    "VALUES (%s, %s, %s, %s, %s, %s)").format(_identifier(_with_table(self.config.table, MARKER_TABLE))),
            (task.transaction_id, task.sink_id, task.batch_id, task.partition_id, task.attempt, rows),
        )
        conn.tpc_prepare()
        conn.close()
        logger.info("sink %s batch %s partition %s txn %s: prepared %s rows", self.sink_id, task.batch_id,
                    task.partition_id, task.transaction_id, rows)
        return Committable(task.sink_id, task.batch_id, task.partition_id, task.attempt, task.transaction_id, rows)

    def abort_open(self, transaction: _PreparedTransaction) -> None:
        try:
            transaction.conn.tpc_rollback()
        finally:
            transaction.conn.close()

    def commit(self, committable: Committable) -> CommitOutcome:
        with self.connect(autocommit=True) as conn:
            if self._finish_prepared(conn, committable.transaction_id, commit=True):
                return CommitOutcome.COMMITTED
            if self._marker_visible(conn, committable.transaction_id):
                return CommitOutcome.ALREADY_COMMITTED
        raise CommitError(
            f"{FORMAT} sink {self.sink_id} batch {committable.batch_id} partition {committable.partition_id}: "
            f"prepared transaction {committable.transaction_id} is gone and its marker is not visible: "
            "it was rolled back, so the checkpoint's output for this partition is lost"
        )

    def abort(self, committable: Committable) -> CommitOutcome:
        with self.connect(autocommit=True) as conn:
            return self._rollback_prepared(conn, committable.transaction_id)

    def _rollback_prepared(self, conn: psycopg.Connection[Any], transaction_id: str) -> CommitOutcome:
        if self._finish_prepared(conn, transaction_id, commit=False):
            return CommitOutcome.ABORTED
        if self._marker_visible(conn, transaction_id):
            raise CommitError(f"{FORMAT} sink {self.sink_id}: transaction {transaction_id} was to be aborted "
                              "but is committed")
        return CommitOutcome.ALREADY_ABORTED

    def _finish_prepared(self, conn: psycopg.Connection[Any], transaction_id: str, commit: bool) -> bool:
        """COMMIT or ROLLBACK PREPARED; False when the id is gone. The listener, the driver's
        recovery and tasks may finish the same transaction at once: the loser sees it "busy"
        (SQLSTATE 55000) and retries until it is gone."""
        import psycopg

        for _ in range(100):
            try:
                (conn.tpc_commit if commit else conn.tpc_rollback)(transaction_id)
                return True
            except psycopg.errors.UndefinedObject:
                return False
            except (psycopg.errors.ObjectNotInPrerequisiteState, psycopg.errors.ObjectInUse):
                time.sleep(0.1)
        raise CommitError(f"{FORMAT} sink {self.sink_id}: prepared transaction {transaction_id} stayed busy for 10 s")

    def _marker_visible(self, conn: psycopg.Connection[Any], transaction_id: str) -> bool:
        from psycopg import sql

        row = conn.execute(sql.SQL("SELECT 1 FROM {} WHERE transaction_id = %s").format(
            _identifier(_with_table(self.config.table, MARKER_TABLE))), (transaction_id,)).fetchone()
        return row is not None

    def leftovers(self, batch_ids: Iterable[int] | None = None, conn: psycopg.Connection[Any] | None = None) -> list[Committable]:
        """Prepared transactions of this sink in this database (``pg_prepared_xacts``)."""
        wanted = None if batch_ids is None else set(batch_ids)
        prefix = f"oncekit:{self.sink_id}:"
        own = conn is None
        conn = conn or self.connect(autocommit=True)
        try:
            found = conn.execute(
                "SELECT gid FROM pg_prepared_xacts WHERE database = current_database() AND starts_with(gid, %s)",
                (prefix,),
            ).fetchall()
        finally:
            if own:
                conn.close()
        out = []
        for (gid,) in found:
            gid = gid.decode() if isinstance(gid, bytes) else gid  # SQL_ASCII databases answer bytes
            batch, partition, attempt = (int(p) for p in gid[len(prefix):].split(":"))
            if wanted is None or batch in wanted:
                out.append(Committable(self.sink_id, batch, partition, attempt, gid, 0))
        return out


@dataclass
class _PreparedTransaction:
    task: TaskInfo
    conn: Any
    writer: _TableWriter


class PostgresWriteAheadSink(_PostgresSink, WriteAheadSink):
    """Tasks stage Arrow files under the checkpoint; on completion one transaction writes them and
    records (sink, batch) in ``oncekit_checkpoints``, so a repeated notification writes nothing."""

    def __init__(self, config: PostgresSinkConfig, checkpoint: str) -> None:
        super().__init__(config, checkpoint)
        self.staged = StagedFiles(checkpoint, config.sink_id)

    def _create_tables(self, conn: psycopg.Connection[Any]) -> None:
        from psycopg import sql

        super()._create_tables(conn)
        conn.execute(sql.SQL(
            "CREATE TABLE IF NOT EXISTS {} (sink_id text NOT NULL, batch_id bigint NOT NULL, rows bigint NOT NULL, "
            "committed_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (sink_id, batch_id))"
        ).format(_identifier(_with_table(self.config.table, CHECKPOINT_TABLE))))

    def send_values(self, batch_id: int, committables: Sequence[Committable], crash: Any = None) -> CommitOutcome:
        from psycopg import sql

        with self.connect() as conn:
            # Recording first takes the row lock: a concurrent notification waits here, then
            # finds the row and writes nothing.
            recorded = conn.execute(
                sql.SQL("INSERT INTO {} (sink_id, batch_id, rows) VALUES (%s, %s, %s) ON CONFLICT DO NOTHING RETURNING 1").format(
                    _identifier(_with_table(self.config.table, CHECKPOINT_TABLE))),
                (self.sink_id, batch_id, sum(c.rows for c in committables)),
            ).fetchone()
            if recorded is None:
                conn.rollback()
                return CommitOutcome.ALREADY_COMMITTED
            for index, committable in enumerate(committables):
                if index and crash is not None:
                    crash("mid_commit", batch_id)
                task = TaskInfo(self.sink_id, batch_id, committable.partition_id, committable.attempt)
                staging = self.staging_table(task)
                if staging:
                    self.create_staging(conn, staging, temporary=True)
                writer = _TableWriter(self, conn, task, staging)
                for batch in self.staged.read(committable):
                    writer.write(batch)
                if staging:
                    conn.execute(sql.SQL("DROP TABLE {}").format(sql.Identifier(staging)))
            conn.commit()
        return CommitOutcome.COMMITTED


class PostgresIdempotentSink(_PostgresSink, IdempotentSink):
    """Tasks merge by key and commit at once: a replayed batch rewrites the same rows."""

    def upsert(self, task: TaskInfo, batches: Iterator[pa.RecordBatch]) -> int:
        return self.write_and_commit(task, batches)


class PostgresAtLeastOnceSink(_PostgresSink):
    """Tasks append and commit at once. A batch re-run after a crash writes its rows again."""

    protocol = "at-least-once"

    def write_partition(self, task: TaskInfo, batches: Iterator[pa.RecordBatch]) -> Committable | None:
        self.write_and_commit(task, batches)
        return None


def postgres_sink(dsn: str, table: str, protocol: str = "two-phase-commit", **options: Any) -> PostgresSinkConfig:
    """The typed builder: ``postgres_sink(dsn, "balances", "two-phase-commit", key_columns=("account_id",))``."""
    if "key_columns" in options:
        options["key_columns"] = tuple(options["key_columns"])
    return PostgresSinkConfig(dsn=dsn, table=table, protocol=protocol, **options)


__all__ = [
    "BadRecordError",
    "PostgresAtLeastOnceSink",
    "PostgresIdempotentSink",
    "PostgresSinkConfig",
    "PostgresTwoPhaseCommitSink",
    "PostgresWriteAheadSink",
    "postgres_sink",
]

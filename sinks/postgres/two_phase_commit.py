"""PostgreSQL two-phase commit: tasks PREPARE a transaction per partition, the driver COMMITs
PREPARED once the checkpoint completes. Needs ``max_prepared_transactions`` > 0 on the server."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import psycopg
import pyarrow as pa
from psycopg import sql

from oncekit.connectors.postgres import prepared_transactions
from oncekit.core.errors import CommitError, ConfigError
from oncekit.core.names import TransactionId
from oncekit.core.protocol import CommitOutcome, Committable, TaskInfo, TwoPhaseCommitSink
from oncekit.sinks.postgres._common import (
    FORMAT,
    MARKER_TABLE,
    PostgresSinkBase,
    TableWriter,
    add_once,
    identifier,
    in_schema_of,
)

logger = logging.getLogger(__name__)

MARKER_INDEX = f"{MARKER_TABLE}_batch_partition"
"""The marker table's unique index on (sink_id, batch_id, partition_id)."""


class PostgresTwoPhaseCommitSink(PostgresSinkBase, TwoPhaseCommitSink["_PreparedTransaction"]):
    """Tasks prepare, the driver commits prepared. A marker row in each prepared transaction tells
    "committed" from "rolled back" once the id has left ``pg_prepared_xacts``; its unique key per
    (sink, batch, partition) lets at most one transaction of a batch's partition commit, whichever
    run prepared it (two drivers on one checkpoint), and a second one waits for the first to
    finish (a lock wait that gives up after the pool's lock timeout) before it can prepare."""

    BATCH_RECORDS = MARKER_TABLE

    def preflight(self, resumed: bool = False) -> None:
        with self.connection(autocommit=True) as conn:
            row = conn.execute("SHOW max_prepared_transactions").fetchone()
            if row is None or int(row[0]) == 0:
                raise ConfigError(f"{FORMAT} sink {self.sink_id}: the server has max_prepared_transactions = 0; "
                                  "set it above the number of partitions times two (postgres -c max_prepared_transactions=64) and restart it")
        super().preflight(resumed)

    def _create_tables(self, conn: psycopg.Connection[Any]) -> None:
        super()._create_tables(conn)
        markers = identifier(in_schema_of(self.config.table, MARKER_TABLE))
        conn.execute(sql.SQL(
            "CREATE TABLE IF NOT EXISTS {} (transaction_id text PRIMARY KEY, sink_id text NOT NULL, batch_id bigint NOT NULL, "
            "partition_id int NOT NULL, attempt bigint NOT NULL, rows bigint NOT NULL, prepared_at timestamptz NOT NULL DEFAULT now())"
        ).format(markers))
        index = in_schema_of(self.config.table, MARKER_INDEX)
        try:
            add_once(conn, index, "unique index on (sink_id, batch_id, partition_id)",
                     "SELECT 1 WHERE to_regclass(%s) IS NOT NULL",
                     sql.SQL("CREATE UNIQUE INDEX IF NOT EXISTS {} ON {} (sink_id, batch_id, partition_id)").format(
                         sql.Identifier(MARKER_INDEX), markers))
        except psycopg.errors.UniqueViolation as exc:
            raise ConfigError(
                f"{FORMAT} sink {self.sink_id}: marker table {in_schema_of(self.config.table, MARKER_TABLE)} records two "
                f"committed transactions of one batch's partition ({exc.diag.message_detail or exc}): that output was "
                "committed twice by two drivers on one checkpoint before this kit version fenced them. Remove the "
                "duplicate rows from the target and the extra marker row, then start again") from exc
        if not self._attempt_is_bigint(conn):
            self._migrate_attempt(conn, markers)

    def _attempt_is_bigint(self, conn: psycopg.Connection[Any]) -> bool:
        """Whether the marker table's ``attempt`` column holds Spark's 64-bit task attempt ids
        (tables made before this kit version have ``int``, which fails past 2^31). Asked once
        per process."""
        table = in_schema_of(self.config.table, MARKER_TABLE)
        if table not in _BIGINT_ATTEMPT:
            row = conn.execute("SELECT format_type(atttypid, atttypmod) FROM pg_attribute WHERE attrelid = %s::regclass "
                               "AND attname = 'attempt'", (table,)).fetchone()
            _BIGINT_ATTEMPT[table] = row is not None and row[0] == "bigint"
        return _BIGINT_ATTEMPT[table]

    def _migrate_attempt(self, conn: psycopg.Connection[Any], markers: sql.Composable) -> None:
        """Driver, preflight: ``attempt`` int -> bigint. The ALTER needs the table to itself, and a
        prepared transaction holds its lock until it is finished (recovery finishes this sink's
        right after the preflight; another query's may hold it any time), so it waits 3 s at
        most and is tried again at the next start; until then markers keep the attempt's low
        31 bits (the transaction id, which recovery reads, keeps all of it)."""
        table = in_schema_of(self.config.table, MARKER_TABLE)
        try:
            with conn.transaction():
                conn.execute("SET LOCAL lock_timeout = '3s'")
                conn.execute(sql.SQL("ALTER TABLE {} ALTER COLUMN attempt TYPE bigint").format(markers))
            _BIGINT_ATTEMPT[table] = True
            logger.warning("sink %s: marker table %s migrated: attempt is bigint", self.sink_id, table)
        except psycopg.errors.LockNotAvailable:
            logger.warning("sink %s: marker table %s has attempt int (fails past 2^31 task attempts); its migration "
                           "to bigint waits for prepared transactions to finish and is tried at the next start",
                           self.sink_id, table)

    def committed_before(self, task: TaskInfo) -> bool:
        """Whether a committed marker of (sink, batch, partition) is visible: another run
        committed this partition of the batch (markers of forgotten batches are gone, and Spark
        never runs those again)."""
        with self.connection(autocommit=True) as conn:
            row = conn.execute(sql.SQL("SELECT 1 FROM {} WHERE sink_id = %s AND batch_id = %s AND partition_id = %s").format(
                identifier(in_schema_of(self.config.table, MARKER_TABLE))),
                (self.sink_id, task.batch_id, task.partition_id)).fetchone()
        return row is not None

    def begin_transaction(self, task: TaskInfo) -> _PreparedTransaction:
        conn = self.take_connection(autocommit=True)
        try:
            stale = [c for c in self.leftovers([task.batch_id], conn)
                     if c.partition_id == task.partition_id and (not task.epoch or c.epoch <= task.epoch)]
            for committable in stale:  # an earlier attempt or run; Spark re-runs the batch, so it never completed
                logger.info("sink %s batch %s partition %s txn %s: aborting stale attempt", self.sink_id,
                            task.batch_id, task.partition_id, committable.transaction_id)
                self._rollback_prepared(conn, committable.name)
            staging = self.unlogged_staging(conn, task)
            conn.autocommit = False
        except BaseException:
            self._failed(task, conn)
            raise
        logger.info("sink %s batch %s partition %s txn %s: begin", self.sink_id, task.batch_id, task.partition_id,
                    task.transaction_id)
        return _PreparedTransaction(task, conn, TableWriter(self, conn, task, staging))

    def write(self, transaction: _PreparedTransaction, batch: pa.RecordBatch) -> None:
        transaction.writer.write(batch)

    def pre_commit(self, transaction: _PreparedTransaction) -> Committable:
        """Task: PREPARE with plain SQL under ``task.transaction_id`` (what ``tpc_commit`` on the
        driver names): unlike psycopg's ``tpc_prepare`` it leaves the session idle, so the
        connection goes back to the pool for the next task."""
        task, conn = transaction.task, transaction.conn
        try:
            rows = transaction.writer.finish()
            self.check_epoch(conn, f"batch {task.batch_id} partition {task.partition_id}", lock=False)
            attempt = task.attempt if task.attempt < 2**31 or self._attempt_is_bigint(conn) else task.attempt % 2**31
            conn.execute(
                sql.SQL("INSERT INTO {} (transaction_id, sink_id, batch_id, partition_id, attempt, rows) "
                        "VALUES (%s, %s, %s, %s, %s, %s)").format(identifier(in_schema_of(self.config.table, MARKER_TABLE))),
                (task.transaction_id, task.sink_id, task.batch_id, task.partition_id, attempt, rows),
            )
            with conn.cursor() as cur:
                try:
                    cur.execute(sql.SQL("PREPARE TRANSACTION {}").format(sql.Literal(task.transaction_id)))
                except psycopg.errors.OutOfMemory as exc:  # SQLSTATE 53200, also the server's for full slots
                    if "prepared transactions" not in (exc.diag.message_primary or ""):
                        raise
                    raise CommitError(
                        f"{FORMAT} sink {self.sink_id} batch {task.batch_id} partition {task.partition_id}: "
                        f"PREPARE TRANSACTION refused: {exc.diag.message_primary} ({exc.diag.message_hint}); "
                        "pg_prepared_xacts lists them, oncekit status shows the kit's with their age: finish forgotten "
                        "ones or raise the setting, then restart the query (nothing of this batch was committed)") from exc
                # An aborted transaction answers PREPARE with a ROLLBACK instead of an error.
                if cur.statusmessage != "PREPARE TRANSACTION":
                    raise CommitError(f"{FORMAT} sink {self.sink_id} batch {task.batch_id} partition {task.partition_id}: "
                                      f"PREPARE TRANSACTION {task.transaction_id} answered {cur.statusmessage}")
        except BaseException:
            self._failed(task, conn)
            raise
        self.give_back(conn)
        logger.info("sink %s batch %s partition %s txn %s: prepared %s rows", self.sink_id, task.batch_id,
                    task.partition_id, task.transaction_id, rows)
        return Committable(task.sink_id, task.batch_id, task.partition_id, task.attempt, rows,
                           transaction_id=task.transaction_id, epoch=task.epoch)

    def abort_open(self, transaction: _PreparedTransaction) -> None:
        """Task: closing the session rolls its transaction (and any COPY in flight) back."""
        self._failed(transaction.task, transaction.conn)

    def _failed(self, task: TaskInfo, conn: psycopg.Connection[Any]) -> None:
        conn.close()
        self.forget_unlogged_staging(task)

    def commit(self, committable: Committable) -> CommitOutcome:
        with self.connection(autocommit=True) as conn:
            if self._finish_prepared(conn, committable.name, commit=True):
                return CommitOutcome.COMMITTED
            if self._marker_visible(conn, committable.name):
                return CommitOutcome.ALREADY_COMMITTED
        raise CommitError(
            f"{FORMAT} sink {self.sink_id} batch {committable.batch_id} partition {committable.partition_id}: "
            f"prepared transaction {committable.transaction_id} is gone and its marker is not visible: "
            "it was rolled back, so the checkpoint's output for this partition is lost"
        )

    def abort(self, committable: Committable) -> CommitOutcome:
        with self.connection(autocommit=True) as conn:
            return self._rollback_prepared(conn, committable.name)

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

        row = conn.execute(sql.SQL("SELECT 1 FROM {} WHERE transaction_id = %s").format(
            identifier(in_schema_of(self.config.table, MARKER_TABLE))), (transaction_id,)).fetchone()
        return row is not None

    def leftovers(self, batch_ids: Iterable[int] | None = None, conn: psycopg.Connection[Any] | None = None) -> list[Committable]:
        """Prepared transactions of this sink in this database (``pg_prepared_xacts``)."""
        wanted = None if batch_ids is None else set(batch_ids)
        with nullcontext(conn) if conn is not None else self.connection(autocommit=True) as session:
            found = prepared_transactions(session, TransactionId.sink_prefix(self.sink_id))
        ids = [(gid, TransactionId.parse(gid)) for gid in found]
        return [Committable(self.sink_id, t.batch_id, t.partition_id, t.attempt, 0, transaction_id=gid, epoch=t.epoch)
                for gid, t in ids if t is not None and t.sink_id == self.sink_id and (wanted is None or t.batch_id in wanted)]


_BIGINT_ATTEMPT: dict[str, bool] = {}  # marker table: whether its attempt column is bigint (per process)


@dataclass
class _PreparedTransaction:
    task: TaskInfo
    conn: psycopg.Connection[Any]
    writer: TableWriter

"""The PostgreSQL sinks' target through psycopg: every statement the protocols cause, in one place
(:class:`~oncekit.sinks.postgres._target.PostgresTarget` says what each operation guarantees).

Sessions come from the process's pool (:mod:`oncekit.sinks.postgres._pool`): the driver's with
the server ending them after :data:`~oncekit.sinks.postgres._target.DRIVER_IDLE_S` idle inside a
transaction, the tasks' after the task bound. Identifiers are quoted with :mod:`psycopg.sql`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import sql

from oncekit.connectors.postgres import prepared_transactions
from oncekit.connectors.redact import redact_dsn
from oncekit.core.errors import CommitError, FencedError, OncekitError
from oncekit.core.names import TransactionId
from oncekit.core.protocol import Committable, SinkOwner, TaskInfo
from oncekit.sinks.postgres import _schema as schema
from oncekit.sinks.postgres._common import (CHECKPOINT_TABLE, DECISION_TABLE, FORMAT, MARKER_TABLE, OWNER_TABLE,
                                            PARTITION_TABLE, in_schema_of)
from oncekit.sinks.postgres._pool import POOL
from oncekit.sinks.postgres._table_writer import TableWriter, identifier
from oncekit.sinks.postgres._target import (DRIVER_IDLE_S, PostgresTarget, PreparingTransaction, older_batch,
                                            task_idle_s)

if TYPE_CHECKING:
    import pyarrow as pa

    from oncekit.sinks.postgres.config import PostgresSinkConfig

logger = logging.getLogger(__name__)

BUSY_S = 10.0
"""How long a prepared transaction another session is finishing may stay busy before giving up."""


class PsycopgTarget(PostgresTarget):
    """A sink's table and the kit's tables on a PostgreSQL server, through pooled psycopg sessions."""

    def __init__(self, config: PostgresSinkConfig) -> None:
        super().__init__(config)
        self.sink_id = config.sink_id
        self._owners = identifier(in_schema_of(config.table, OWNER_TABLE))
        self._markers = identifier(in_schema_of(config.table, MARKER_TABLE))
        self._decisions = identifier(in_schema_of(config.table, DECISION_TABLE))

    # -- sessions ------------------------------------------------------------------------------

    def take(self, autocommit: bool, idle_s: int = DRIVER_IDLE_S) -> psycopg.Connection[Any]:
        """A pooled session whose statements give up after waiting the pool's lock timeout: a task
        blocked by a prepared transaction of a lost attempt fails (and is retried, or the query
        restarts and recovery aborts that transaction) instead of waiting forever."""
        try:
            return POOL.take(self.config.dsn, autocommit, idle_s)
        except psycopg.OperationalError as exc:
            raise OncekitError(f"{FORMAT} sink {self.sink_id}: cannot connect: {redact_dsn(str(exc)).strip()}") from exc

    def give_back(self, conn: psycopg.Connection[Any], idle_s: int = DRIVER_IDLE_S) -> None:
        POOL.give_back(self.config.dsn, idle_s, conn)

    @contextmanager
    def session(self, autocommit: bool = True, idle_s: int = DRIVER_IDLE_S) -> Iterator[psycopg.Connection[Any]]:
        """A pooled session for the block, closed if the block raised."""
        conn = self.take(autocommit, idle_s)
        try:
            yield conn
        except BaseException:
            conn.close()
            raise
        self.give_back(conn, idle_s)

    def fence(self, conn: psycopg.Connection[Any], epoch: int, where: str, lock: bool) -> None:
        """Inside the caller's transaction: FencedError (the transaction then rolls back) when the
        sink's row holds a newer epoch than ``epoch``, or ``epoch`` is none. With ``lock``, the
        row is share-locked until the transaction ends, so a newer run's epoch waits for it and
        no older commit lands after the newer epoch; call it at the transaction's end, so the lock
        is held for its last statement and the commit only."""
        if epoch < 1:
            raise FencedError(f"{FORMAT} sink {self.sink_id} {where}: acts for no query run (epoch {epoch}); "
                              "nothing of this is committed")
        row = conn.execute(sql.SQL("SELECT epoch FROM {} WHERE sink_id = %s{}").format(
            self._owners, sql.SQL(" FOR SHARE" if lock else "")), (self.sink_id,)).fetchone()
        if row is not None and int(row[0]) > epoch:
            raise FencedError(f"{FORMAT} sink {self.sink_id} {where}: this run (epoch {epoch}) was superseded by "
                              f"epoch {row[0]}: another driver took the query over; nothing of this is committed")

    # -- driver: checks, epoch, owner ----------------------------------------------------------

    def preflight(self) -> None:
        with self.session() as conn:
            schema.preflight(self.config, conn)

    def take_epoch(self, checkpoint: str, floor: int) -> int:
        with self.session() as conn:
            row = conn.execute(sql.SQL(
                "INSERT INTO {} AS s (sink_id, query_id, checkpoint, epoch) VALUES (%s, '', %s, %s) ON CONFLICT "
                "(sink_id) DO UPDATE SET epoch = GREATEST(s.epoch, EXCLUDED.epoch - 1) + 1 RETURNING epoch"
            ).format(self._owners), (self.sink_id, checkpoint, floor + 1)).fetchone()
        if row is None:
            raise CommitError(f"{FORMAT} sink {self.sink_id}: the server returned no epoch")
        return int(row[0])

    def hold_epoch(self, checkpoint: str, epoch: int) -> None:
        with self.session() as conn:
            row = conn.execute(sql.SQL(
                "INSERT INTO {} AS s (sink_id, query_id, checkpoint, epoch) VALUES (%s, '', %s, %s) ON CONFLICT "
                "(sink_id) DO UPDATE SET epoch = GREATEST(s.epoch, EXCLUDED.epoch) RETURNING epoch"
            ).format(self._owners), (self.sink_id, checkpoint, epoch)).fetchone()
        if row is not None and int(row[0]) > epoch:
            raise FencedError(f"{FORMAT} sink {self.sink_id}: this run (epoch {epoch}) was superseded by epoch "
                              f"{row[0]}: another driver took the query over")

    def owner(self) -> SinkOwner | None:
        with self.session() as conn:
            row = conn.execute(sql.SQL("SELECT query_id, checkpoint FROM {} WHERE sink_id = %s").format(self._owners),
                               (self.sink_id,)).fetchone()
        return None if row is None or not row[0] else SinkOwner(row[0], row[1])

    def record_owner(self, owner: SinkOwner, epoch: int) -> None:
        with self.session() as conn:
            changed = conn.execute(sql.SQL(
                "UPDATE {} SET query_id = %s, checkpoint = %s, claimed_at = now() WHERE sink_id = %s AND epoch <= %s"
            ).format(self._owners), (owner.query_id, owner.checkpoint, self.sink_id, epoch)).rowcount
        if not changed or epoch < 1:
            raise FencedError(f"{FORMAT} sink {self.sink_id}: recording query {owner.query_id} as the owner: this run "
                              f"(epoch {epoch}) was superseded, or took no epoch here")

    def delete_batch_records(self, table: str, before: int | None, epoch: int) -> int:
        below = sql.SQL("") if before is None else sql.SQL(" AND batch_id < %s")
        with self.session(autocommit=False) as conn:
            deleted = conn.execute(sql.SQL("DELETE FROM {} WHERE sink_id = %s{}").format(
                identifier(in_schema_of(self.config.table, table)), below),
                (self.sink_id,) if before is None else (self.sink_id, before)).rowcount
            self.fence(conn, epoch, f"deleting rows of {table}", lock=True)
            conn.commit()
        return deleted

    # -- two-phase commit ----------------------------------------------------------------------

    def prepared(self, batch_ids: Iterable[int] | None) -> list[Committable]:
        wanted = None if batch_ids is None else set(batch_ids)
        with self.session() as conn:
            found = prepared_transactions(conn, TransactionId.sink_prefix(self.sink_id))
        ids = [(gid, TransactionId.parse(gid)) for gid in found]
        return [Committable(self.sink_id, t.batch_id, t.partition_id, t.attempt, 0, transaction_id=gid, epoch=t.epoch)
                for gid, t in ids if t is not None and t.sink_id == self.sink_id and (wanted is None or t.batch_id in wanted)]

    def finish_prepared(self, transaction_id: str, commit: bool) -> bool:
        """COMMIT or ROLLBACK PREPARED. The listener, the driver's recovery and tasks may finish
        the same transaction at once: the loser sees it "busy" (SQLSTATE 55000) and retries until
        it is gone."""
        deadline = time.monotonic() + BUSY_S
        with self.session() as conn:
            while True:
                try:
                    (conn.tpc_commit if commit else conn.tpc_rollback)(transaction_id)
                    return True
                except psycopg.errors.UndefinedObject:
                    return False
                except (psycopg.errors.ObjectNotInPrerequisiteState, psycopg.errors.ObjectInUse):
                    if time.monotonic() > deadline:
                        raise CommitError(f"{FORMAT} sink {self.sink_id}: prepared transaction {transaction_id} stayed "
                                          f"busy for {BUSY_S:.0f} s") from None
                    time.sleep(0.1)

    def marker_visible(self, transaction_id: str) -> bool:
        with self.session() as conn:
            return conn.execute(sql.SQL("SELECT 1 FROM {} WHERE transaction_id = %s").format(self._markers),
                                (transaction_id,)).fetchone() is not None

    def begin(self, task: TaskInfo) -> PreparingTransaction:
        idle_s = task_idle_s()
        conn = self.take(autocommit=True, idle_s=idle_s)
        try:
            staging = schema.unlogged_staging(self.config, conn, task)
            conn.autocommit = False
        except BaseException:
            conn.close()
            schema.forget_unlogged_staging(self.config, task)
            raise
        return _Preparing(self, task, conn, TableWriter(self.config, conn, task, staging), idle_s)

    def decide(self, batch_id: int, epoch: int, verdict: str) -> str:
        with self.session(autocommit=False) as conn:
            if verdict == "decided":
                self.fence(conn, epoch, f"batch {batch_id}", lock=True)
            conn.execute(sql.SQL("INSERT INTO {} (sink_id, batch_id, epoch, verdict) VALUES (%s, %s, %s, %s) "
                                 "ON CONFLICT DO NOTHING").format(self._decisions), (self.sink_id, batch_id, epoch, verdict))
            row = conn.execute(sql.SQL("SELECT verdict FROM {} WHERE sink_id = %s AND batch_id = %s AND epoch = %s")
                               .format(self._decisions), (self.sink_id, batch_id, epoch)).fetchone()
            conn.commit()
        return str(row[0]) if row is not None else verdict

    def decisions(self, batch_ids: Iterable[int]) -> dict[int, set[int]]:
        wanted = sorted(set(batch_ids))
        found: dict[int, set[int]] = {b: set() for b in wanted}
        if not wanted:
            return found
        with self.session() as conn:
            for batch_id, epoch in conn.execute(sql.SQL(
                    "SELECT batch_id, epoch FROM {} WHERE sink_id = %s AND verdict = 'decided' AND batch_id = ANY(%s)")
                    .format(self._decisions), (self.sink_id, wanted)):
                found[int(batch_id)].add(int(epoch))
        return found

    # -- write-ahead log, idempotent, at-least-once --------------------------------------------

    def publish(self, batch_id: int, epoch: int, rows: int,
                parts: Iterator[tuple[TaskInfo, Iterator[pa.RecordBatch]]]) -> bool:
        with self.session() as conn:
            staging = schema.temporary_staging(self.config, conn)
            conn.autocommit = False
            checkpoints = identifier(in_schema_of(self.config.table, CHECKPOINT_TABLE))
            if conn.execute(sql.SQL("SELECT 1 FROM {} WHERE sink_id = %s AND batch_id = %s").format(checkpoints),
                            (self.sink_id, batch_id)).fetchone() is not None:
                conn.rollback()  # published before: skip the writing
                return False
            for task, batches in parts:
                writer = TableWriter(self.config, conn, task, staging)
                for batch in batches:
                    writer.write(batch)
                writer.finish()
            # Fenced last: the share lock holds a newer run's take_epoch off only from here to
            # the commit. Recording last: a concurrent publisher of the batch waits here, then
            # finds the row and this one writes nothing (its rows roll back).
            self.fence(conn, epoch, f"batch {batch_id}", lock=True)
            recorded = conn.execute(sql.SQL(
                "INSERT INTO {} (sink_id, batch_id, rows) VALUES (%s, %s, %s) ON CONFLICT DO NOTHING RETURNING 1"
            ).format(checkpoints), (self.sink_id, batch_id, rows)).fetchone()
            if recorded is None:
                conn.rollback()
                return False
            conn.commit()
        return True

    def published(self, batch_id: int) -> bool:
        checkpoints = identifier(in_schema_of(self.config.table, CHECKPOINT_TABLE))
        with self.session() as conn:
            return conn.execute(sql.SQL("SELECT 1 FROM {} WHERE sink_id = %s AND batch_id = %s").format(checkpoints),
                                (self.sink_id, batch_id)).fetchone() is not None

    def write_and_commit(self, task: TaskInfo, batches: Iterator[pa.RecordBatch], epoch: int | None) -> int:
        idle_s = task_idle_s()
        with self.session(idle_s=idle_s) as conn:
            staging = schema.temporary_staging(self.config, conn)
            conn.autocommit = False
            writer = TableWriter(self.config, conn, task, staging)
            for batch in batches:
                writer.write(batch)
            rows = writer.finish()
            if epoch is not None:
                where = f"batch {task.batch_id} partition {task.partition_id}"
                self.fence(conn, epoch, where, lock=True)
                # Any partition's later batch refuses this one: a newer run may plan fewer tasks.
                newest = conn.execute(sql.SQL(
                    "INSERT INTO {table} AS p (sink_id, partition_id, batch_id) SELECT %s, %s, %s WHERE NOT EXISTS "
                    "(SELECT 1 FROM {table} WHERE sink_id = %s AND batch_id > %s) ON CONFLICT (sink_id, partition_id) "
                    "DO UPDATE SET batch_id = EXCLUDED.batch_id RETURNING batch_id").format(
                        table=identifier(in_schema_of(self.config.table, PARTITION_TABLE))),
                    (self.sink_id, task.partition_id, task.batch_id, self.sink_id, task.batch_id)).fetchone()
                if newest is None:
                    raise older_batch(self.sink_id, where)
            conn.commit()
        logger.info("sink %s batch %s partition %s: wrote and committed %s rows", self.sink_id, task.batch_id,
                    task.partition_id, rows)
        return rows


class _Preparing(PreparingTransaction):
    def __init__(self, target: PsycopgTarget, task: TaskInfo, conn: psycopg.Connection[Any], writer: TableWriter,
                 idle_s: int) -> None:
        super().__init__(task)
        self.target, self.conn, self.writer, self.idle_s = target, conn, writer, idle_s

    def write(self, batch: pa.RecordBatch) -> None:
        self.writer.write(batch)

    def prepare(self) -> int:
        """PREPARE with plain SQL under ``task.transaction_id`` (what ``tpc_commit`` on the driver
        names): unlike psycopg's ``tpc_prepare`` it leaves the session idle, so the connection
        goes back to the pool for the next task."""
        task, conn, config = self.task, self.conn, self.target.config
        where = f"{FORMAT} sink {task.sink_id} batch {task.batch_id} partition {task.partition_id}"
        try:
            rows = self.writer.finish()
            self.target.fence(conn, task.epoch, f"batch {task.batch_id} partition {task.partition_id}", lock=False)
            attempt = task.attempt if task.attempt < 2**31 or schema.attempt_is_bigint(config, conn) else task.attempt % 2**31
            try:
                conn.execute(
                    sql.SQL("INSERT INTO {} (transaction_id, sink_id, batch_id, partition_id, attempt, rows) "
                            "VALUES (%s, %s, %s, %s, %s, %s)").format(self.target._markers),
                    (task.transaction_id, task.sink_id, task.batch_id, task.partition_id, attempt, rows),
                )
            except psycopg.errors.UniqueViolation as exc:
                raise CommitError(f"{where}: another attempt committed this partition of the batch meanwhile; this "
                                  "attempt commits nothing (its retry finds the batch committed)") from exc
            with conn.cursor() as cur:
                try:
                    cur.execute(sql.SQL("PREPARE TRANSACTION {}").format(sql.Literal(task.transaction_id)))
                except psycopg.errors.OutOfMemory as exc:  # SQLSTATE 53200, also the server's for full slots
                    if "prepared transactions" not in (exc.diag.message_primary or ""):
                        raise
                    raise CommitError(
                        f"{where}: PREPARE TRANSACTION refused: {exc.diag.message_primary} ({exc.diag.message_hint}); "
                        "pg_prepared_xacts lists them, oncekit status shows the kit's with their age: finish forgotten "
                        "ones or raise the setting, then restart the query (nothing of this batch was committed)") from exc
                # An aborted transaction answers PREPARE with a ROLLBACK instead of an error.
                if cur.statusmessage != "PREPARE TRANSACTION":
                    raise CommitError(f"{where}: PREPARE TRANSACTION {task.transaction_id} answered {cur.statusmessage}")
        except psycopg.OperationalError as exc:
            self.abort()
            raise OncekitError(f"{where}: the session was lost before PREPARE (ended by the server after "
                               f"{self.idle_s} s idle in its transaction?): {exc}") from exc
        except BaseException:
            self.abort()
            raise
        self.target.give_back(conn, self.idle_s)
        return rows

    def abort(self) -> None:
        """Closing the session rolls its transaction (and any COPY in flight) back."""
        self.conn.close()
        schema.forget_unlogged_staging(self.target.config, self.task)


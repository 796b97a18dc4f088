"""PostgreSQL write-ahead log: tasks stage Arrow files under the checkpoint; once it completes,
one transaction writes them and records (sink, batch) in ``oncekit_checkpoints``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from psycopg import sql

from oncekit.core.protocol import CommitOutcome, Committable, TaskInfo, WriteAheadSink
from oncekit.core.staging import StagedFiles
from oncekit.sinks.postgres._common import CHECKPOINT_TABLE, PostgresSinkBase, identifier, in_schema_of

if TYPE_CHECKING:
    import psycopg

    from oncekit.sinks.postgres.config import PostgresSinkConfig


class PostgresWriteAheadSink(PostgresSinkBase, WriteAheadSink):
    """Tasks stage Arrow files under the checkpoint; on completion one transaction writes them and
    records (sink, batch) in ``oncekit_checkpoints``, so a repeated notification writes nothing."""

    BATCH_RECORDS = CHECKPOINT_TABLE

    def __init__(self, config: PostgresSinkConfig, checkpoint: str) -> None:
        super().__init__(config, checkpoint)
        self.staged = StagedFiles(checkpoint, config.sink_id)

    def _create_tables(self, conn: psycopg.Connection[Any]) -> None:
        super()._create_tables(conn)
        conn.execute(sql.SQL(
            "CREATE TABLE IF NOT EXISTS {} (sink_id text NOT NULL, batch_id bigint NOT NULL, rows bigint NOT NULL, "
            "committed_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (sink_id, batch_id))"
        ).format(identifier(in_schema_of(self.config.table, CHECKPOINT_TABLE))))

    def send_values(self, batch_id: int, committables: Sequence[Committable]) -> CommitOutcome:
        with self.connection(autocommit=True) as conn:
            staging = self.temporary_staging(conn)
            conn.autocommit = False
            # Fenced first: a newer run's epoch refuses this send; the share lock holds the newer
            # run's take_epoch off until this transaction ends.
            self.check_epoch(conn, f"batch {batch_id}", lock=True)
            # Recording first takes the row lock: a concurrent notification waits here, then
            # finds the row and writes nothing.
            recorded = conn.execute(
                sql.SQL("INSERT INTO {} (sink_id, batch_id, rows) VALUES (%s, %s, %s) ON CONFLICT DO NOTHING RETURNING 1").format(
                    identifier(in_schema_of(self.config.table, CHECKPOINT_TABLE))),
                (self.sink_id, batch_id, sum(c.rows for c in committables)),
            ).fetchone()
            if recorded is None:
                conn.rollback()
                return CommitOutcome.ALREADY_COMMITTED
            for committable, batches in self.staged_batches(batch_id, committables):
                task = TaskInfo(self.sink_id, batch_id, committable.partition_id, committable.attempt, committable.epoch)
                self.write_rows(conn, task, batches, staging)
            conn.commit()
        return CommitOutcome.COMMITTED

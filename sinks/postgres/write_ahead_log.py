"""PostgreSQL write-ahead log: tasks stage Arrow files under the checkpoint; once it completes,
one transaction writes them and records (sink, batch) in ``oncekit_checkpoints``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from oncekit.core.bases import WriteAheadSink
from oncekit.core.protocol import CommitOutcome, Committable, TaskInfo
from oncekit.core.staging import StagedFiles
from oncekit.sinks.postgres._common import CHECKPOINT_TABLE, PostgresSinkBase

if TYPE_CHECKING:
    from oncekit.sinks.postgres.config import PostgresSinkConfig


class PostgresWriteAheadSink(PostgresSinkBase, WriteAheadSink):
    """Tasks stage Arrow files under the checkpoint; on completion one transaction writes them and
    records (sink, batch) in ``oncekit_checkpoints``, so a repeated notification writes nothing.
    The transaction checks the sink's epoch at its end, share-locking the sink's row only from
    there to its commit: a superseded run's publish is refused, and a driver frozen while it
    writes holds nothing a newer run's start needs."""

    BATCH_RECORDS = (CHECKPOINT_TABLE,)

    def __init__(self, config: PostgresSinkConfig, checkpoint: str) -> None:
        super().__init__(config, checkpoint)
        self.staged = StagedFiles(checkpoint, config.sink_id)

    def send_values(self, batch_id: int, committables: Sequence[Committable]) -> CommitOutcome:
        parts = ((TaskInfo(self.sink_id, batch_id, c.partition_id, c.attempt, c.epoch), batches)
                 for c, batches in self.staged_batches(batch_id, committables))
        try:
            published = self.target.publish(batch_id, self.epoch, sum(c.rows for c in committables), parts)
        except FileNotFoundError:
            # Another notification of the batch (the listener, a catch-up) published it and
            # deleted its staged files while this one read them: nothing is lost.
            if self.target.published(batch_id):
                return CommitOutcome.ALREADY_COMMITTED
            raise
        return CommitOutcome.COMMITTED if published else CommitOutcome.ALREADY_COMMITTED

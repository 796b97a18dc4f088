"""PostgreSQL idempotent writes: tasks merge by key and commit at once."""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa

from oncekit.core.bases import IdempotentSink
from oncekit.core.protocol import TaskInfo
from oncekit.sinks.postgres._common import PostgresSinkBase


class PostgresIdempotentSink(PostgresSinkBase, IdempotentSink):
    """Tasks merge by key and commit at once: a replayed batch rewrites the same rows. The task's
    transaction checks the sink's epoch before its commit, so a stale task of a superseded run
    never puts an older value back over a newer run's."""

    def upsert(self, task: TaskInfo, batches: Iterator[pa.RecordBatch]) -> int:
        return self.target.write_and_commit(task, batches, task.epoch)

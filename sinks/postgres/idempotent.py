"""PostgreSQL idempotent writes: tasks merge by key and commit at once."""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa

from oncekit.core.protocol import IdempotentSink, TaskInfo
from oncekit.sinks.postgres._common import PostgresSinkBase


class PostgresIdempotentSink(PostgresSinkBase, IdempotentSink):
    """Tasks merge by key and commit at once: a replayed batch rewrites the same rows."""

    def upsert(self, task: TaskInfo, batches: Iterator[pa.RecordBatch]) -> int:
        return self.write_and_commit(task, batches)

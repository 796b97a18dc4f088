"""PostgreSQL idempotent writes: tasks merge by key and commit at once."""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa

from oncekit.core.bases import IdempotentSink
from oncekit.core.protocol import TaskInfo
from oncekit.sinks.postgres._common import PARTITION_TABLE, PostgresSinkBase


class PostgresIdempotentSink(PostgresSinkBase, IdempotentSink):
    """Tasks merge by key and commit at once: a replayed batch rewrites the same rows. The task's
    transaction checks, before its commit, the sink's epoch (a stale task of a superseded run
    never puts an older value back over a newer run's) and the newest batch any partition's rows
    come from (``oncekit_partitions``; a newer run may have planned fewer tasks): a driver whose Spark read the checkpoint before another
    driver wrote later batches, and then took the newest epoch, cannot write an older batch over
    them either (CommitError, and its restart reads the checkpoint again)."""

    PARTITION_RECORDS = (PARTITION_TABLE,)

    def upsert(self, task: TaskInfo, batches: Iterator[pa.RecordBatch]) -> int:
        return self.target.write_and_commit(task, batches, task.epoch)

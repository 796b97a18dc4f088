"""PostgreSQL at-least-once appends, for comparison: a replayed batch writes its rows again."""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa

from oncekit.core.bases import AtLeastOnceSink
from oncekit.core.protocol import TaskInfo
from oncekit.sinks.postgres._common import PostgresSinkBase


class PostgresAtLeastOnceSink(PostgresSinkBase, AtLeastOnceSink):
    """Tasks append and commit at once. A batch re-run after a crash writes its rows again."""

    def append(self, task: TaskInfo, batches: Iterator[pa.RecordBatch]) -> int:
        return self.target.write_and_commit(task, batches, None)

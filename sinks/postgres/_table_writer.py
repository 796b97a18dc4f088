"""The partition writer of the PostgreSQL sinks: Arrow batches streamed as CSV through one COPY
into the caller's open transaction, or merged by key through a staging table when the target
already holds a key. Never row-by-row INSERT: a refused row fails the batch with an error naming
sink, batch, partition, row and column, or, with a dead-letter table, goes there with the
server's error text. Used by the psycopg target (:mod:`oncekit.sinks.postgres._psycopg`) only."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np
import psycopg
import pyarrow as pa
from psycopg import sql

from oncekit.core.errors import BadRecordError, OncekitError
from oncekit.core.protocol import TaskInfo
from oncekit.sinks.postgres._common import FORMAT
from oncekit.sinks.postgres._csv import csv_for_copy
from oncekit.sinks.postgres._pool import LOCK_TIMEOUT_S

if TYPE_CHECKING:
    from oncekit.sinks.postgres.config import PostgresSinkConfig

logger = logging.getLogger(__name__)

ORDINAL = "oncekit_row"
"""The staging tables' extra column: a row's position in its COPY, which orders repeated keys."""

SEGMENT_BYTES = 64 << 20
"""For a sink that merges or has a dead-letter table, the Arrow bytes one COPY carries at most:
a refused segment is written again from memory, so this bounds what the writer keeps."""

_SAVEPOINT = "oncekit_rows"
_REFUSED = (psycopg.errors.DataError, psycopg.errors.IntegrityError)


def identifier(name: str) -> sql.Identifier:
    """``schema.table`` or ``table`` as a quoted identifier."""
    return sql.Identifier(*name.split(".", 1))


class TableWriter:
    """Streams one partition's Arrow batches into the target inside the caller's open transaction.

    Task or driver: ``write`` each batch, then ``finish``. Batches stream through one COPY
    straight into the target, so the server parses rows while the next batch is rendered. A sink
    that merges by key, or has a dead-letter table, COPYs per segment of at most SEGMENT_BYTES
    under a savepoint and keeps the segment's batches until it is in. A merging segment the
    target refuses for a duplicate key (a key the target holds, or one the segment repeats) is
    rolled back and merged instead: COPY into the staging table with each row's ordinal, one
    INSERT ... SELECT ... ON CONFLICT, TRUNCATE the staging table. When the segment repeats a key
    (found in Arrow), DISTINCT ON keeps one row of it, since ON CONFLICT cannot touch a row twice
    in one statement: the last for ``on_conflict="update"``, the first for ``"nothing"``, as
    across batches. A segment still refused fails the batch with BadRecordError or, with a
    dead-letter table, is retried batch by batch and a refused batch row by row, so only the
    refused rows go there.
    """

    def __init__(self, config: PostgresSinkConfig, conn: psycopg.Connection[Any], task: TaskInfo,
                 staging: sql.Composable | None) -> None:
        self.conn, self.task, self.staging = conn, task, staging
        self.config = config
        self.rows = 0
        self._guarded = bool(self.config.key_columns or self.config.dead_letter_table)
        self._stack = ExitStack()
        self._copy: psycopg.Copy | None = None
        self._names: list[str] = []
        self._segment: list[pa.RecordBatch] = []
        self._segment_rows = 0
        self._segment_bytes = 0

    def write(self, batch: pa.RecordBatch) -> None:
        """Send one batch; a refusal surfaces at the end of its segment."""
        if batch.num_rows == 0:
            return
        with self._named_errors():
            if self._copy is None:
                self._names = batch.schema.names
                self._copy = self._open(staged=False)
            self._send(self._copy, batch, None)
        self._segment_rows += batch.num_rows
        if self._guarded:
            self._segment.append(batch)
            self._segment_bytes += batch.nbytes
            if self._segment_bytes >= SEGMENT_BYTES:
                self._close_segment()

    def finish(self) -> int:
        """End the COPY (and any merge); return the partition's rows."""
        if self._copy is not None:
            self._close_segment()
        return self.rows

    def _open(self, staged: bool) -> psycopg.Copy:
        """Start a COPY into the target, or into the staging table with the ordinal column."""
        if self._guarded:
            self.conn.execute(f"SAVEPOINT {_SAVEPOINT}")
        into, columns = (self.staging, [*self._names, ORDINAL]) if staged else (identifier(self.config.table), self._names)
        statement = sql.SQL("COPY {} ({}) FROM STDIN (FORMAT csv)").format(
            into, sql.SQL(", ").join(map(sql.Identifier, columns)))
        return self._stack.enter_context(self._stack.enter_context(self.conn.cursor()).copy(statement))

    def _send(self, copy: psycopg.Copy, batch: pa.RecordBatch, ordinal: int | None) -> None:
        if ordinal is not None:
            batch = batch.append_column(ORDINAL, pa.array(np.arange(ordinal, ordinal + batch.num_rows)))
        copy.write(memoryview(csv_for_copy(batch)))

    def _end(self) -> None:
        """End the COPY: where the server reports a refused row."""
        self._copy = None
        self._stack.close()

    def _close_segment(self) -> None:
        segment, rows = self._segment, self._segment_rows
        self._segment, self._segment_rows, self._segment_bytes = [], 0, 0
        with self._named_errors():
            try:
                self._end()
            except _REFUSED as exc:
                if not self._guarded:
                    raise self._bad_record(exc) from exc
                self._roll_back()
                refusal = self._attempt(segment) if self._merges_after(exc) else exc
                if refusal is not None:
                    if not self.config.dead_letter_table:
                        raise self._bad_record(refusal) from refusal
                    self._salvage(segment)
            else:
                if self._guarded:
                    self.conn.execute(f"RELEASE SAVEPOINT {_SAVEPOINT}")
        self.rows += rows

    def _merges_after(self, exc: psycopg.Error) -> bool:
        """Whether a merge may take what a straight COPY refused: a duplicate key, not a bad row."""
        return self.staging is not None and isinstance(exc, psycopg.errors.UniqueViolation)

    def _attempt(self, batches: list[pa.RecordBatch]) -> psycopg.Error | None:
        """Write ``batches`` under a savepoint (merged when the sink merges); the server's
        refusal, rolled back, or None."""
        staged = self.staging is not None
        copy = self._open(staged)
        try:
            ordinal = 0
            for batch in batches:
                self._send(copy, batch, ordinal if staged else None)
                ordinal += batch.num_rows
            self._end()
            if staged:
                self._merge(batches)
        except _REFUSED as exc:
            self._roll_back()
            return exc
        self.conn.execute(f"RELEASE SAVEPOINT {_SAVEPOINT}")
        return None

    def _merge(self, batches: list[pa.RecordBatch]) -> None:
        keys = pa.Table.from_batches([batch.select(list(self.config.key_columns)) for batch in batches])
        repeated = keys.group_by(keys.column_names).aggregate([]).num_rows < keys.num_rows
        key_list = sql.SQL(", ").join(map(sql.Identifier, self.config.key_columns))
        columns = sql.SQL(", ").join(map(sql.Identifier, self._names))
        updates = [c for c in self._names if c not in self.config.key_columns]
        action: sql.Composable = sql.SQL("DO NOTHING")
        if self.config.on_conflict == "update" and updates:
            action = sql.SQL("DO UPDATE SET {}").format(
                sql.SQL(", ").join(sql.SQL("{0} = EXCLUDED.{0}").format(sql.Identifier(c)) for c in updates))
        distinct: sql.Composable = sql.SQL("")
        order: sql.Composable = sql.SQL("")
        if repeated:
            distinct = sql.SQL("DISTINCT ON ({}) ").format(key_list)
            order = sql.SQL(" ORDER BY {}, {} {}").format(
                key_list, sql.Identifier(ORDINAL), sql.SQL("DESC" if self.config.on_conflict == "update" else "ASC"))
        self.conn.execute(sql.SQL(
            "INSERT INTO {target} ({columns}) SELECT {distinct}{columns} FROM {staging}{order} ON CONFLICT ({keys}) {action}"
        ).format(target=identifier(self.config.table), columns=columns, distinct=distinct, staging=self.staging,
                 order=order, keys=key_list, action=action))
        self.conn.execute(sql.SQL("TRUNCATE {}").format(self.staging))

    def _roll_back(self) -> None:
        self.conn.execute(f"ROLLBACK TO SAVEPOINT {_SAVEPOINT}; RELEASE SAVEPOINT {_SAVEPOINT}")

    def _salvage(self, segment: list[pa.RecordBatch]) -> None:
        """A refused segment again, batch by batch, then a refused batch row by row; refused rows
        go to the dead-letter table with the server's error."""
        dead = identifier(self.config.dead_letter_table or "")
        refused, offset = 0, self.rows
        for batch in segment:
            if self._attempt([batch]) is not None:
                for index in range(batch.num_rows):
                    row = batch.slice(index, 1)
                    exc = self._attempt([row])
                    if exc is None:
                        continue
                    refused += 1
                    record = json.dumps(row.to_pylist()[0], default=lambda v: v.hex() if isinstance(v, bytes) else str(v))
                    self.conn.execute(
                        sql.SQL("INSERT INTO {} (sink_id, batch_id, partition_id, row_number, record, error) "
                                "VALUES (%s, %s, %s, %s, %s, %s)").format(dead),
                        (self.task.sink_id, self.task.batch_id, self.task.partition_id, offset + index, record,
                         str(exc.diag.message_primary or exc)),
                    )
            offset += batch.num_rows
        logger.warning("sink %s batch %s partition %s: %s rows refused, sent to %s", self.task.sink_id,
                       self.task.batch_id, self.task.partition_id, refused, self.config.dead_letter_table)

    @contextmanager
    def _named_errors(self) -> Iterator[None]:
        """The server's errors that are not about one row, raised naming sink, batch, partition
        and table: a lock held too long, the target dropped or changed under the running query."""
        where = f"{FORMAT} sink {self.task.sink_id} batch {self.task.batch_id} partition {self.task.partition_id}"
        try:
            yield
        except psycopg.errors.LockNotAvailable as exc:
            raise OncekitError(
                f"{where}: waited {LOCK_TIMEOUT_S} s for rows another transaction holds: two partitions of one batch "
                "write the same key (repartition the stream by the key columns), or a lost attempt left a prepared "
                "transaction (the restart's recovery aborts it)"
            ) from exc
        except (psycopg.errors.UndefinedTable, psycopg.errors.UndefinedColumn, psycopg.errors.InsufficientPrivilege) as exc:
            raise OncekitError(
                f"{where}: table {self.config.table}: {exc.diag.message_primary or exc} (changed while the query ran?); "
                "nothing of this batch was committed: restore the table, then restart the query, which replays the batch"
            ) from exc

    def _bad_record(self, exc: Any) -> BadRecordError:
        diag = exc.diag
        line = re.search(r"line (\d+)", diag.context or "")
        named = re.search(r"column (\w+)", diag.context or "")
        column = diag.column_name or (named.group(1) if named else None)
        where = f"row {self.rows + int(line.group(1)) - 1} of the partition" if line else "a row"
        return BadRecordError(
            f"{FORMAT} sink {self.task.sink_id} batch {self.task.batch_id} partition {self.task.partition_id}: "
            f"{where}, column {column or '?'}: {diag.message_primary or exc}; nothing of this batch was committed"
        )

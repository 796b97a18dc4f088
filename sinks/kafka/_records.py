"""A Kafka sink's records as Arrow arrays, part by part as Spark delivers them, with the
order-independent checksum of the batch markers. No Python code runs per record: Arrow converts
the columns to lists of bytes once, and the checksum is computed in C."""

from __future__ import annotations

import functools
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from oncekit.core.errors import ConfigError, RecordError


@dataclass(frozen=True)
class Records:
    """Records of a partition (or batch), or one part of them: binary key and value arrays of
    equal length."""

    keys: pa.Array
    values: pa.Array

    def __len__(self) -> int:
        return len(self.values)

    @functools.cached_property
    def python_keys(self) -> list[bytes | None]:
        """The keys as librdkafka takes them (converted by Arrow, once)."""
        return self.keys.to_pylist()  # type: ignore[no-any-return]

    @functools.cached_property
    def python_values(self) -> list[bytes | None]:
        return self.values.to_pylist()  # type: ignore[no-any-return]

    @property
    def crc_total(self) -> int:
        """The sum of each record's CRC-32 of key and value, iterated and computed in C; the
        totals of parts add up to the total of the whole (see :func:`checksum`)."""
        values = pc.fill_null(self.values, b"").to_pylist() if self.values.null_count else self.python_values
        if self.keys.null_count == len(self.keys):
            return sum(map(zlib.crc32, values))
        keys = pc.fill_null(self.keys, b"").to_pylist() if self.keys.null_count else self.python_keys
        return sum(map(zlib.crc32, values, map(zlib.crc32, keys)))

    @classmethod
    def of_batch(cls, batch: pa.RecordBatch, where: str, first_row: int = 0) -> Records:
        """The batch's ``key`` (optional) and ``value`` columns, string or binary, as binary
        arrays; ``first_row`` is the batch's first row in the task, for errors."""
        names = batch.schema.names
        if "value" not in names:
            raise ConfigError(f"{where}: the stream needs a value column; it has {', '.join(names)}")
        values = _as_binary(batch.column(names.index("value")), where, "value", first_row)
        keys = (_as_binary(batch.column(names.index("key")), where, "key", first_row) if "key" in names
                else pa.nulls(batch.num_rows, pa.binary()))
        return cls(keys, values)


def checksum(rows: int, crc_total: int) -> str:
    """The batch marker's checksum of ``rows`` records whose CRC-32s add up to ``crc_total``:
    order-independent, since a replay may deliver a partition's rows in another order."""
    return f"{rows:x}-{crc_total % (1 << 64):016x}"


class RecordStream:
    """A task's (or batch's) records part by part as they arrive, so that producing overlaps
    with Spark still sending the input. Each part is converted once and kept: an attempt that
    starts over (a fenced producer) iterates the same parts again, then goes on reading."""

    def __init__(self, parts: Iterable[Records]) -> None:
        self._source = iter(parts)
        self._kept: list[Records] = []

    @classmethod
    def of(cls, batches: Iterable[pa.RecordBatch], where: str) -> RecordStream:
        """The records of Spark's Arrow ``batches``, rows numbered from the first batch on."""

        def parts() -> Iterator[Records]:
            rows = 0
            for batch in batches:
                if batch.num_rows:
                    yield Records.of_batch(batch, where, rows)
                    rows += batch.num_rows

        return cls(parts())

    def __iter__(self) -> Iterator[Records]:
        index = 0
        while True:
            if index == len(self._kept):
                part = next(self._source, None)
                if part is None:
                    return
                self._kept.append(part)
            yield self._kept[index]
            index += 1


def _as_binary(column: pa.Array, where: str, name: str, first_row: int) -> pa.Array:
    """A string or binary column as binary (no copy); any other type fails naming the first row
    that holds a value of it (a column of nulls only is nulls)."""
    if pa.types.is_binary(column.type):
        return column
    if pa.types.is_string(column.type):
        return column.view(pa.binary())  # the same buffers, read as bytes
    if pa.types.is_large_string(column.type) or pa.types.is_large_binary(column.type):
        return column.cast(pa.binary())
    if column.null_count == len(column):
        return pa.nulls(len(column), pa.binary())
    row = first_row + pc.index(pc.is_valid(column), True).as_py()
    raise RecordError(f"{where}: row {row}, column {name}: cannot serialize {column.type}; give string or binary")

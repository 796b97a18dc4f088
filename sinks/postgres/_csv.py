"""Arrow batches as CSV for PostgreSQL's COPY, rendered in C by pyarrow and numpy.

NULL is an unquoted empty field and an empty string a quoted one (pyarrow's CSV writer does
both); bytes become bytea hex (``\\x0aff``); lists, structs and maps become JSON text for json
and jsonb columns (maps as objects, nested bytes as hex strings, nested times as text). No value
passes through Python.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

_OPTIONS = pacsv.WriteOptions(include_header=False)
_TEXT = pa.large_string()

# Byte b -> its two lowercase hex digits as one little-endian uint16 (the digits in memory order).
_HEX_DIGITS = np.frombuffer(b"".join(f"{b:02x}".encode() for b in range(256)), dtype="<u2")

_UTC = ("UTC", "Etc/UTC", "+00:00", "Z", "GMT", "Etc/GMT")
"""Time zones of a timestamp column whose wall time is UTC's (Spark sends its session time zone)."""

_JSON_ESCAPES = {0x08: "\\b", 0x09: "\\t", 0x0A: "\\n", 0x0C: "\\f", 0x0D: "\\r"}


def csv_for_copy(batch: pa.RecordBatch) -> pa.Buffer:
    """One Arrow batch as CSV rows (no header) for ``COPY ... (FORMAT csv)``."""
    columns = [_for_csv(column) for column in batch.columns]
    out = pa.BufferOutputStream()
    pacsv.write_csv(pa.RecordBatch.from_arrays(columns, names=batch.schema.names), out, _OPTIONS)
    return out.getvalue()


def _for_csv(column: pa.Array) -> pa.Array:
    if pa.types.is_timestamp(column.type) and column.type.tz in _UTC:
        # the UTC wall time and its offset: a tenth of the time pyarrow's zoned formatting takes
        return _join(column.cast(pa.timestamp(column.type.unit)).cast(_TEXT), _literal("+00"))
    if _is_binary(column.type):
        return _join(_literal("\\x"), _hex(column))
    if pa.types.is_nested(column.type):
        return _json(column)
    return column


def _is_binary(kind: pa.DataType) -> bool:
    return bool(pa.types.is_binary(kind) or pa.types.is_large_binary(kind) or pa.types.is_fixed_size_binary(kind))


def _hex(column: pa.Array) -> pa.Array:
    """Each value's bytes as hex digits (null stays null): one table lookup per byte in numpy."""
    if not pa.types.is_large_binary(column.type):
        column = column.cast(pa.large_binary())
    n = len(column)
    _, offsets_buffer, data_buffer = column.buffers()
    offsets = np.frombuffer(offsets_buffer, dtype=np.int64)[column.offset:column.offset + n + 1]
    data = np.frombuffer(data_buffer, dtype=np.uint8) if data_buffer is not None else np.empty(0, np.uint8)
    digits = _HEX_DIGITS[data[offsets[0]:offsets[-1]]]
    validity = column.is_valid().buffers()[1] if column.null_count else None
    return pa.Array.from_buffers(_TEXT, n, [validity, pa.py_buffer((offsets - offsets[0]) * 2), pa.py_buffer(digits)],
                                 null_count=column.null_count)


def _json(values: pa.Array) -> pa.Array:
    """JSON text of each value; a null value stays null (the caller decides what null means)."""
    kind = values.type
    if pa.types.is_dictionary(kind):
        return _json(values.dictionary_decode())
    if pa.types.is_null(kind):
        return pa.nulls(len(values), _TEXT)
    if pa.types.is_boolean(kind):
        return pc.if_else(values, _literal("true"), _literal("false"))
    if pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_decimal(kind):
        return values.cast(_TEXT)
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return _quoted(values)
    if _is_binary(kind):
        return _quoted(_join(_literal("\\x"), _hex(values)))
    if pa.types.is_map(kind):
        entries = values.cast(pa.list_(pa.struct([kind.key_field, kind.item_field])))
        keys, items = entries.flatten().flatten()
        keys = keys if pa.types.is_string(keys.type) else keys.cast(pa.string())
        return _enclosed(entries, _join(_quoted(keys), _literal(":"), _elements(items)), "{", "}")
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        return _enclosed(values, _elements(values.flatten()), "[", "]")
    if pa.types.is_struct(kind):
        fields = [_join(_literal(json.dumps(kind.field(i).name) + ":"), _elements(field))
                  for i, field in enumerate(values.flatten())]
        members = pc.binary_join_element_wise(*fields, _literal(",")) if fields else pa.array([""] * len(values), _TEXT)
        obj = _join(_literal("{"), members, _literal("}"))
        return pc.if_else(values.is_null(), pa.scalar(None, _TEXT), obj)
    return _quoted(values.cast(pa.string()))


def _elements(values: pa.Array) -> pa.Array:
    """JSON text of values nested in a list, map or struct: null is ``null``."""
    return _json(values).fill_null("null")


def _enclosed(lists: pa.Array, elements: pa.Array, opening: str, closing: str) -> pa.Array:
    """``[a,b]`` (or ``{a,b}``) per list of ``lists`` from its elements' JSON (``lists.flatten()``
    order); a null list stays null."""
    lengths = pc.list_value_length(lists).fill_null(0).to_numpy(zero_copy_only=False)
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]))
    joined = pc.binary_join(pa.LargeListArray.from_arrays(offsets, elements, mask=lists.is_null()), _literal(","))
    return _join(_literal(opening), joined, _literal(closing))


def _quoted(strings: pa.Array) -> pa.Array:
    """JSON string literals: quotes, backslashes and control characters escaped."""
    text = pc.replace_substring(strings.cast(_TEXT), "\\", "\\\\")
    text = pc.replace_substring(text, '"', '\\"')
    if pc.any(pc.match_substring_regex(text, r"[\x00-\x1f]")).as_py():
        for code in range(0x20):
            text = pc.replace_substring(text, chr(code), _JSON_ESCAPES.get(code, f"\\u{code:04x}"))
    return _join(_literal('"'), text, _literal('"'))


def _join(*parts: pa.Array | pa.Scalar) -> pa.Array:
    """Element-wise concatenation; null where any part is null."""
    return pc.binary_join_element_wise(*parts, _literal(""))


def _literal(text: str) -> pa.Scalar:
    return pa.scalar(text, _TEXT)

"""The reference pipeline's stateful step: :class:`PaymentProcessor`, Spark's
applyInPandasWithState keyed by a bucket of accounts. Runs in Spark's Python workers; importing
this module imports pyspark, pandas and numpy.

Why one processor does balance and event time, rather than a windowed aggregation: the producer
keys payments by account, so an account's events sit in one Kafka partition in a fixed order.
The processor takes each batch's rows of an account in offset order, so which events are late
is a pure function of the log, the same whatever the batch boundaries and however often a batch
is replayed. Spark's global watermark moves per batch, and its windowed aggregation drops late
rows without a side output. Here the watermark is per account (newest event time seen minus
``allowed_lateness_s``), like Flink's per-partition watermarks; a minute whose end is behind it
is final and leaves the state. Duplicates are dropped before, in the JVM (see
:meth:`ReferencePipeline.processed`).

Why buckets of accounts, columns instead of rows, and applyInPandasWithState rather than
transformWithStateInPandas: Spark's Python side of a stateful step costs a fixed few
milliseconds per grouping key and batch, so keyed by account that cost is paid for every
account in every batch; keyed by bucket (``account mod buckets``,
:meth:`ReferencePipeline.processed`) it is paid ``buckets`` times, and :func:`process` handles a
bucket's rows of a batch with numpy over whole columns. Its output goes back as columns too:
one row per call with a list per column (:data:`PROCESSED_SCHEMA`), unpacked in the JVM.
applyInPandasWithState hands each group its rows as a slice of the Arrow batch converted to
pandas a column at a time, with the group's state beside them; PySpark 4.3's
transformWithStateInPandas turns every input row into a Python tuple and rebuilds the frames
from those tuples, which cost its worker about 10 us per row, most of the processor's time
(docs/reference-pipeline.md, "Where the time goes").
Each account's rules are unchanged: its payments are taken in (partition, offset) order and its
clock before a payment is the running maximum of the stored clock and the event times before
it, so the accounts sharing a bucket do not see each other. A bucket's whole state (per account:
balance, payment count, clock; per open minute: total and count) is one state value, read once
and written once per batch.

Balances count every unique well-formed payment, late ones included (money is money); only
the per-minute totals leave late payments out, and the side output lists them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
from pyspark.sql.streaming.state import GroupState

PROCESSOR_VERSION = 6
"""Part of every query's fingerprint: bump it when the processor's state layout changes, so
that restoring an old savepoint is refused instead of misreading state (6: applyInPandasWithState,
one state per bucket; 5: transformWithStateInPandas, one state per bucket of accounts; 3: one
per account)."""

OUTPUT_COLUMNS = (
    ("kind", "string"), ("account_id", "bigint"), ("balance_cents", "bigint"), ("events", "bigint"),
    ("minute_ms", "bigint"), ("total_cents", "bigint"), ("event_id", "string"), ("amount_cents", "bigint"),
    ("event_ms", "bigint"), ("watermark_ms", "bigint"), ("kafka_partition", "int"), ("kafka_offset", "bigint"),
    ("raw", "string"), ("reason", "string"),
)
"""The processor's output rows: of kind ``balance``, ``total``, ``late`` and ``dead``, each
with the columns of its kind (:data:`GIVEN`), the others NULL."""

GIVEN = {
    "dead": ("kafka_partition", "kafka_offset", "raw", "reason"),
    "late": ("account_id", "event_id", "amount_cents", "event_ms", "watermark_ms"),
    "balance": ("account_id", "balance_cents", "events"),
    "total": ("account_id", "minute_ms", "total_cents", "events"),
}
"""The columns each kind of output row gives; the rest of its columns are NULL."""

PROCESSED_SCHEMA = ", ".join(f"{name} array<{kind}>" for name, kind in OUTPUT_COLUMNS)
"""What the processor hands Spark per call: one row, each of :data:`OUTPUT_COLUMNS` as an array
over the call's output rows, where a column its row's kind does not give holds 0 or NULL
(:func:`packed`). :func:`oncekit.reference.stages.route` unpacks it in the JVM. One row, not one
per output row: PySpark 4.3's worker concatenates a task's output frames and pads their state
with a frame as long as them in pandas, checking every all-NULL object cell one at a time, which
cost the worker more than the processor itself (docs/reference-pipeline.md, "Where the time goes")."""

INPUT_COLUMNS = ("account_id", "event_id", "amount_cents", "event_ms", "kafka_partition", "kafka_offset", "raw", "reason")
"""The columns the processor reads (by name). ``reason`` is NULL for a payment; for any other
record the numeric columns hold 0, never NULL, so that they reach pandas as exact int64."""

STATE_SCHEMA = "bucket binary"
"""A bucket's state: :meth:`BucketState.dump`'s bytes. (PySpark 4.3's worker cannot read an
applyInPandasWithState state schema with array columns: ``KeyError: 'elementType'``.)"""

MINUTE_MS = 60_000
NO_CLOCK = np.iinfo(np.int64).min
"""The clock of an account before its first payment: no watermark, nothing is late."""


@dataclass(frozen=True)
class BucketState:
    """What a bucket keeps between batches, as int64 arrays: per account (ascending) its balance,
    number of payments and clock (newest event time seen); per open (account, minute), ascending,
    the minute's total and number of on-time payments."""

    accounts: np.ndarray
    balances: np.ndarray
    events: np.ndarray
    clocks: np.ndarray
    minute_accounts: np.ndarray
    minutes: np.ndarray
    minute_totals: np.ndarray
    minute_events: np.ndarray

    @classmethod
    def load(cls, stored: tuple[Any, ...] | None) -> BucketState:
        """From the group state's value (None: a bucket that has seen no payment)."""
        if stored is None:
            return cls(*(np.zeros(0, dtype=np.int64) for _ in range(8)))
        values = np.frombuffer(stored[0], dtype="<i8")
        accounts, minutes = int(values[0]), int(values[1])
        ends = np.cumsum([2] + [accounts] * 4 + [minutes] * 4)
        return cls(*(values[start:end].astype(np.int64) for start, end in zip(ends[:-1], ends[1:])))

    def dump(self) -> tuple[bytes]:
        """The group state's value (``STATE_SCHEMA``): the number of accounts and of open
        minutes, then the eight columns, as little-endian int64."""
        return (np.concatenate([[len(self.accounts), len(self.minutes)], self.accounts, self.balances, self.events,
                                self.clocks, self.minute_accounts, self.minutes, self.minute_totals,
                                self.minute_events]).astype("<i8").tobytes(),)


def _starts(*keys: np.ndarray) -> np.ndarray:
    """The positions where the (sorted) key columns change value, 0 first; empty for no rows."""
    if not len(keys[0]):
        return np.zeros(0, dtype=np.int64)
    changed = np.zeros(len(keys[0]), dtype=bool)
    changed[0] = True
    for key in keys:
        changed[1:] |= key[1:] != key[:-1]
    return np.flatnonzero(changed)


def _ints(frame: pd.DataFrame, column: str) -> np.ndarray:
    return np.asarray(frame[column].to_numpy(), dtype=np.int64)


def process(state: BucketState, rows: pd.DataFrame, lateness_ms: int) -> tuple[BucketState, pd.DataFrame]:
    """One bucket's batch: ``rows`` (``INPUT_COLUMNS``, any order) against ``state``; returns the
    new state and the output rows, packed (:func:`packed`): ``dead`` rows in (partition, offset)
    order, ``late`` payments, one ``balance`` per account with payments in the batch, one
    ``total`` per (account, minute) with on-time payments in the batch. Called by
    :class:`PaymentProcessor`, and by the unit tests."""
    dead = rows["reason"].notna().to_numpy()
    bad = rows[dead].sort_values(["kafka_partition", "kafka_offset"], kind="stable")
    paid = rows[~dead]
    account, partition, offset = _ints(paid, "account_id"), _ints(paid, "kafka_partition"), _ints(paid, "kafka_offset")
    order = np.lexsort((offset, partition, account))  # each account's payments in log order
    account, amount, event_ms = account[order], _ints(paid, "amount_cents")[order], _ints(paid, "event_ms")[order]
    event_id = paid["event_id"].to_numpy()[order]

    # The account's clock before each payment: the stored clock and the event times before it.
    first = _starts(account)
    seen = pd.Series(event_ms).groupby(account).cummax().to_numpy()
    before = np.concatenate(([NO_CLOCK], seen[:-1])) if len(seen) else seen
    before[first] = NO_CLOCK
    stored_at = np.searchsorted(state.accounts, account)
    known = stored_at < len(state.accounts)
    known[known] = state.accounts[stored_at[known]] == account[known]
    before[known] = np.maximum(before[known], state.clocks[stored_at[known]])
    has_clock = before != NO_CLOCK
    watermark = np.full(len(before), NO_CLOCK)
    np.subtract(before, lateness_ms, out=watermark, where=has_clock)
    late = has_clock & (event_ms < watermark)

    # Balances, counts and clocks per account: the stored ones plus the batch's.
    batch_accounts = account[first]
    accounts = np.union1d(state.accounts, batch_accounts)
    at, stored = np.searchsorted(accounts, batch_accounts), np.searchsorted(accounts, state.accounts)
    balances, events, clocks = np.zeros(len(accounts), np.int64), np.zeros(len(accounts), np.int64), np.full(
        len(accounts), NO_CLOCK)
    balances[stored], events[stored], clocks[stored] = state.balances, state.events, state.clocks
    if len(first):
        balances[at] += np.add.reduceat(amount, first)
        events[at] += np.diff(np.append(first, len(account)))
        clocks[at] = np.maximum(clocks[at], np.maximum.reduceat(event_ms, first))

    # Per-minute totals: the batch's on-time payments merged with the open minutes of the state.
    on_time = ~late
    minute = event_ms[on_time] // MINUTE_MS * MINUTE_MS
    merged_account = np.concatenate((state.minute_accounts, account[on_time]))
    merged_minute = np.concatenate((state.minutes, minute))
    by_minute = np.lexsort((merged_minute, merged_account))
    merged_account, merged_minute = merged_account[by_minute], merged_minute[by_minute]
    totals = np.concatenate((state.minute_totals, amount[on_time]))[by_minute]
    counts = np.concatenate((state.minute_events, np.ones(len(minute), np.int64)))[by_minute]
    touched = np.concatenate((np.zeros(len(state.minutes), np.int8), np.ones(len(minute), np.int8)))[by_minute]
    groups = _starts(merged_account, merged_minute)
    minute_accounts, minutes = merged_account[groups], merged_minute[groups]
    if len(groups):
        totals, counts = np.add.reduceat(totals, groups), np.add.reduceat(counts, groups)
        touched = np.maximum.reduceat(touched, groups)
    changed = touched.astype(bool)
    # a minute whose end the account's watermark has reached is final: out of the state
    still_open = minutes + MINUTE_MS > clocks[np.searchsorted(accounts, minute_accounts)] - lateness_ms

    output = packed([
        ("dead", len(bad), {"kafka_partition": _ints(bad, "kafka_partition"), "kafka_offset": _ints(bad, "kafka_offset"),
                            "raw": bad["raw"].to_numpy(), "reason": bad["reason"].to_numpy()}),
        ("late", int(late.sum()), {"account_id": account[late], "event_id": event_id[late], "amount_cents": amount[late],
                                   "event_ms": event_ms[late], "watermark_ms": watermark[late]}),
        ("balance", len(at), {"account_id": batch_accounts, "balance_cents": balances[at], "events": events[at]}),
        ("total", int(changed.sum()), {"account_id": minute_accounts[changed], "minute_ms": minutes[changed],
                                       "total_cents": totals[changed], "events": counts[changed]}),
    ])
    return BucketState(accounts, balances, events, clocks, minute_accounts[still_open], minutes[still_open],
                       totals[still_open], counts[still_open]), output


def packed(sections: list[tuple[str, int, dict[str, np.ndarray]]]) -> pd.DataFrame:
    """The output as one row of lists (:data:`PROCESSED_SCHEMA`) of each section's ``n`` rows of
    one kind, given by the columns :data:`GIVEN` names for it; a column the kind does not give
    holds 0 (numbers) or None (text) there. Lists of Python values, which PySpark's worker
    converts to Arrow without a Python call per value."""
    columns: dict[str, list[list[Any]]] = {}
    for name, kind in OUTPUT_COLUMNS:
        if name == "kind":
            parts = [np.full(n, section, dtype=object) for section, n, _ in sections]
        else:
            dtype, absent = (object, None) if kind == "string" else (np.int64, 0)
            parts = [np.asarray(given[name], dtype=dtype) if name in GIVEN[section] else np.full(n, absent, dtype=dtype)
                     for section, n, given in sections]
        columns[name] = [np.concatenate(parts).tolist()]
    return pd.DataFrame(columns)


class PaymentProcessor:
    """The function applyInPandasWithState calls once per group and batch, keyed by bucket
    (``account mod buckets``; records that are not a payment: by a negative key per partition,
    and passed on as ``dead`` rows). Per batch, each account's payments in Kafka offset order:
    add each to the balance, and split them into on-time (added to their minute's total) and late
    (older than the account's watermark, emitted as ``late``). Emits one ``balance`` row per
    account and one ``total`` row per minute touched in the batch; minutes the watermark has
    passed are final and leave the state (:func:`process`). Runs in Spark's Python workers; every
    decision depends only on each account's log order. Reads the group's state once and writes
    it once per batch, and only for payments."""

    def __init__(self, allowed_lateness_ms: int) -> None:
        self.allowed_lateness_ms = allowed_lateness_ms

    def __call__(self, key: tuple[Any, ...], rows: Iterator[pd.DataFrame], state: GroupState) -> Iterator[pd.DataFrame]:
        frames = [frame for frame in rows if len(frame)]
        if not frames:
            return
        batch = frames[0] if len(frames) == 1 else pd.concat(frames, ignore_index=True)
        if batch["reason"].notna().all():  # only records that are not payments: no state
            yield process(BucketState.load(None), batch, self.allowed_lateness_ms)[1]
            return
        stored = BucketState.load(state.get if state.exists else None)
        updated, output = process(stored, batch, self.allowed_lateness_ms)
        state.update(updated.dump())
        yield output

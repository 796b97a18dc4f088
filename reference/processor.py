"""The reference pipeline's stateful step: :class:`PaymentProcessor`, Spark's
transformWithStateInPandas keyed by account. Runs in Spark's Python workers; importing this
module imports pyspark, pandas and numpy.

Why one processor keyed by account does balance and event time, rather than a windowed
aggregation: the producer keys payments by account, so an account's events sit in one Kafka
partition in a fixed order. The processor takes each batch's rows of an account in offset
order, so which events are late is a pure function of the log, the same whatever the batch
boundaries and however often a batch is replayed. Spark's global watermark moves per batch, and
its windowed aggregation drops late rows without a side output. Here the watermark is per
account (newest event time seen minus ``allowed_lateness_s``), like Flink's per-partition
watermarks; a minute whose end is behind it is final and leaves the state. Duplicates are
dropped before, in the JVM (see :meth:`ReferencePipeline.processed`), and the processor reads
and writes its state (balance, clock and open minutes in one ValueState) once per account and
batch, never once per event or minute.

The processor works on columns, not rows: Spark hands it an account's rows of a batch as pandas
frames (Arrow underneath) and takes back one frame per account, and every per-event step is a
numpy operation over the batch (the clock before each payment is the running maximum of the
event times before it). The row API (transformWithState) turned every input and output row into
a pyspark ``Row`` and ran a Python loop per event, most of the Python worker's time on large
batches. The price is a fixed cost per account and batch (Spark builds a frame per account and
converts each returned frame to Arrow, a few milliseconds): on batches of one or two events per
account the row API was cheaper.

Balances count every unique well-formed payment, late ones included (money is money); only
the per-minute totals leave late payments out, and the side output lists them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pandas as pd
from pyspark.sql.streaming.stateful_processor import StatefulProcessor, StatefulProcessorHandle, TimerValues

PROCESSOR_VERSION = 4
"""Part of every query's fingerprint: bump it when the processor's state layout changes, so
that restoring an old savepoint is refused instead of misreading state."""

PROCESSED_SCHEMA = (
    "kind string, account_id bigint, balance_cents bigint, events bigint, minute_ms bigint, total_cents bigint, "
    "event_id string, amount_cents bigint, event_ms bigint, watermark_ms bigint, "
    "kafka_partition int, kafka_offset bigint, raw string, reason string"
)
"""The processor's output: rows of kind ``balance``, ``total``, ``late`` and ``dead``, other
columns NULL."""

MINUTE_MS = 60_000

_LONGS = ("account_id", "balance_cents", "events", "minute_ms", "total_cents", "amount_cents", "event_ms",
          "watermark_ms", "kafka_partition", "kafka_offset")
_STRINGS = ("event_id", "raw", "reason")
_COLUMNS = ("kind", "account_id", "balance_cents", "events", "minute_ms", "total_cents", "event_id", "amount_cents",
            "event_ms", "watermark_ms", "kafka_partition", "kafka_offset", "raw", "reason")


class _Output:
    """The output frame of one account and batch, filled by column slices: every column NULL
    until a slice of it is set."""

    def __init__(self, rows: int) -> None:
        self.kind = np.empty(rows, dtype=object)
        self.longs = {name: np.zeros(rows, dtype=np.int64) for name in _LONGS}
        self.nulls = {name: np.ones(rows, dtype=bool) for name in _LONGS}
        self.strings = {name: np.full(rows, None, dtype=object) for name in _STRINGS}

    def set(self, name: str, at: slice, values: Any, where: Any = None) -> None:
        """Column ``name`` at rows ``at`` := ``values``; with ``where`` (a mask over those rows),
        only where it is true (the rest stay NULL)."""
        if name in self.strings:
            target = self.strings[name][at]
            if where is None:
                target[:] = values
            else:
                target[where] = np.asarray(values, dtype=object)[where]
            return
        self.longs[name][at] = values
        if where is None:
            self.nulls[name][at] = False
        else:
            self.nulls[name][at] = ~where

    def frame(self) -> pd.DataFrame:
        """The frame, its columns in ``PROCESSED_SCHEMA``'s order and labelled by position: Spark
        takes integer labels by position, where string labels would make it reorder the frame by
        name first, a copy of every column of every frame. Numbers go as pandas' nullable integer
        arrays, which Arrow takes as they are."""
        columns: dict[int, Any] = {}
        for position, name in enumerate(_COLUMNS):
            if name == "kind":
                columns[position] = self.kind
            elif name in self.strings:
                columns[position] = self.strings[name]
            else:
                values = self.longs[name].astype(np.int32) if name == "kafka_partition" else self.longs[name]
                columns[position] = pd.arrays.IntegerArray(values, self.nulls[name])
        return pd.DataFrame(columns, copy=False)


def _longs(column: pd.Series, at: np.ndarray) -> np.ndarray:
    """The values of ``column`` at positions ``at`` (none of them NULL) as int64, whatever dtype
    Spark's Arrow conversion gave the column (int64, Int64, or float64 when it had NULLs)."""
    return np.asarray(column.to_numpy()[at]).astype(np.int64)


def _per_minute(minute: np.ndarray, amount: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The distinct minutes in ``minute`` (ascending) with the sum of ``amount`` and the number of
    rows in each."""
    if not len(minute):
        return minute, amount, np.zeros(0, dtype=np.int64)
    by_minute = np.argsort(minute, kind="stable")
    ordered = minute[by_minute]
    starts = np.concatenate(([0], np.flatnonzero(np.diff(ordered)) + 1))
    return ordered[starts], np.add.reduceat(amount[by_minute], starts), np.diff(np.append(starts, len(ordered)))


class PaymentProcessor(StatefulProcessor):
    """Keyed by account (records that are not a payment: by a negative key per partition, and
    passed on as ``dead`` rows). Per batch, in Kafka offset order: add each payment to the
    balance, and split them into on-time (added to their minute's total) and late (older than
    the account's watermark, emitted as ``late``). Emits one ``balance`` row per account and one
    ``total`` row per minute touched in the batch; minutes the watermark has passed are final and
    leave the state. The account's whole state (balance, clock, open minutes) is one ValueState,
    read once and written once per batch: a state call costs a round trip to the JVM, and per
    minute or per payment those round trips were most of the pipeline's time. Runs in Spark's
    Python workers (transformWithStateInPandas): every per-event step is a column operation over
    the account's rows of the batch, and one frame per account goes back; every decision depends
    only on the log order."""

    def __init__(self, allowed_lateness_ms: int) -> None:
        self.allowed_lateness_ms = allowed_lateness_ms

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.account = handle.getValueState(
            "account", "balance_cents bigint, events bigint, max_event_ms bigint, open_minutes string")

    def handleInputRows(self, key: Any, rows: Iterator[pd.DataFrame],
                        timerValues: TimerValues) -> Iterator[pd.DataFrame]:
        account = int(key[0])
        frames = [frame for frame in rows if len(frame)]
        batch = None if not frames else frames[0] if len(frames) == 1 else pd.concat(frames, ignore_index=True)
        stored = self.account.get()
        balance, events = (int(stored[0]), int(stored[1])) if stored else (0, 0)
        clock: int | None = int(stored[2]) if stored else None
        # the minutes the watermark has not passed yet, stored as JSON {minute_ms: [total_cents, events]}:
        # as three arrays ordered by minute
        open_minutes = sorted((int(m), v[0], v[1]) for m, v in json.loads(stored[3]).items()) if stored else []
        minutes, totals, counts = (np.array(column, dtype=np.int64).reshape(-1) for column in zip(*open_minutes)) \
            if open_minutes else (np.zeros(0, dtype=np.int64),) * 3
        lateness = self.allowed_lateness_ms

        # The batch in log order; ``emit`` marks the rows that are output as they are (dead and late).
        count = 0 if batch is None else len(batch)
        order = np.zeros(0, dtype=np.int64)
        dead = late = np.zeros(0, dtype=bool)
        amount = event_ms = watermark = np.zeros(0, dtype=np.int64)
        touched = touched_totals = touched_counts = np.zeros(0, dtype=np.int64)
        if batch is not None:
            partition = batch["kafka_partition"].to_numpy().astype(np.int64)
            offset = batch["kafka_offset"].to_numpy().astype(np.int64)
            order = np.lexsort((offset, partition))
            dead = ~pd.isna(batch["reason"].to_numpy())[order]
            paid = order[~dead]
            late = np.zeros(count, dtype=bool)
            amount = np.zeros(count, dtype=np.int64)
            event_ms = np.zeros(count, dtype=np.int64)
            watermark = np.zeros(count, dtype=np.int64)
            if len(paid):
                paid_amount, paid_ms = _longs(batch["amount_cents"], paid), _longs(batch["event_ms"], paid)
                # the account's clock before each payment: the running maximum of the stored clock
                # and the payments before it (before the account's first payment there is none:
                # its own time stands in, which makes it on time)
                first = int(paid_ms[0]) if clock is None else clock
                before = np.maximum.accumulate(np.concatenate(([first], paid_ms[:-1])))
                paid_watermark = before - lateness
                paid_late = paid_watermark > paid_ms
                balance += int(paid_amount.sum())
                events += len(paid)
                clock = max(first, int(paid_ms.max()))
                late[~dead], amount[~dead], event_ms[~dead], watermark[~dead] = (
                    paid_late, paid_amount, paid_ms, paid_watermark)
                touched, touched_totals, touched_counts = _per_minute(
                    paid_ms[~paid_late] // MINUTE_MS * MINUTE_MS, paid_amount[~paid_late])
                # the minutes' totals so far: the batch's sums plus what the state holds of them
                position = np.searchsorted(minutes, touched)
                held = position < len(minutes)
                held[held] = minutes[position[held]] == touched[held]
                touched_totals[held] += totals[position[held]]
                touched_counts[held] += counts[position[held]]
                kept = np.ones(len(minutes), dtype=bool)
                kept[position[held]] = False
                minutes, totals, counts = (np.concatenate(pair) for pair in (
                    (minutes[kept], touched), (totals[kept], touched_totals), (counts[kept], touched_counts)))
        emit = dead | late
        emitted = int(emit.sum())
        rows_out = emitted + (0 if clock is None else 1 + len(touched))
        if rows_out:
            out = _Output(rows_out)
            if emitted:
                assert batch is not None
                at, source, was_dead = slice(0, emitted), order[emit], dead[emit]
                was_late = ~was_dead
                out.kind[at] = np.where(was_dead, "dead", "late")
                out.set("kafka_partition", at, batch["kafka_partition"].to_numpy()[source].astype(np.int64), was_dead)
                out.set("kafka_offset", at, batch["kafka_offset"].to_numpy()[source].astype(np.int64), was_dead)
                out.set("raw", at, batch["raw"].to_numpy()[source], was_dead)
                out.set("reason", at, batch["reason"].to_numpy()[source], was_dead)
                out.set("account_id", at, account, was_late)
                out.set("event_id", at, batch["event_id"].to_numpy()[source], was_late)
                out.set("amount_cents", at, amount[emit], was_late)
                out.set("event_ms", at, event_ms[emit], was_late)
                out.set("watermark_ms", at, watermark[emit], was_late)
            if clock is not None:
                at = slice(emitted, emitted + 1)
                out.kind[at] = "balance"
                out.set("account_id", at, account)
                out.set("balance_cents", at, balance)
                out.set("events", at, events)
                at = slice(emitted + 1, rows_out)
                out.kind[at] = "total"
                out.set("account_id", at, account)
                out.set("minute_ms", at, touched)
                out.set("total_cents", at, touched_totals)
                out.set("events", at, touched_counts)
            yield out.frame()
        if clock is None:
            return
        # a minute whose end the watermark has reached is final: out of the state
        still_open = minutes + MINUTE_MS > clock - lateness
        self.account.update((balance, events, clock, json.dumps({
            str(m): [t, n] for m, t, n in zip(minutes[still_open].tolist(), totals[still_open].tolist(),
                                             counts[still_open].tolist())})))

    def close(self) -> None:
        pass

"""The reference pipeline's stateful step: :class:`PaymentProcessor`, Spark's transformWithState
keyed by account. Runs in Spark's Python workers; importing this module imports pyspark.

Why one processor keyed by account does balance and event time, rather than a windowed
aggregation: the producer keys payments by account, so an account's events sit in one Kafka
partition in a fixed order. The processor takes each batch's rows of an account in offset
order, so which events are late is a pure function of the log, the same whatever the batch
boundaries and however often a batch is replayed. Spark's global watermark moves per batch, and
its windowed aggregation drops late rows without a side output. Here the watermark is per
account (newest event time seen minus ``allowed_lateness_s``), like Flink's per-partition
watermarks; a minute whose end is behind it is final and leaves the state. Duplicates are
dropped before, in the JVM (see :meth:`ReferencePipeline.processed`), so the processor reads and
writes its state once per account and batch (balance and clock in ValueStates, open minutes in
a MapState), never once per event.

Balances count every unique well-formed payment, late ones included (money is money); only
the per-minute totals leave late payments out, and the side output lists them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from pyspark.sql import Row
from pyspark.sql.streaming.stateful_processor import StatefulProcessor, StatefulProcessorHandle, TimerValues

PROCESSOR_VERSION = 3
"""Part of every query's fingerprint: bump it when the processor's state layout changes, so
that restoring an old savepoint is refused instead of misreading state."""

PROCESSED_SCHEMA = (
    "kind string, account_id bigint, balance_cents bigint, events bigint, minute_ms bigint, total_cents bigint, "
    "event_id string, amount_cents bigint, event_ms bigint, watermark_ms bigint, "
    "kafka_partition int, kafka_offset bigint, raw string, reason string"
)
"""The processor's output: rows of kind ``balance``, ``total``, ``late`` and ``dead``, other
columns NULL."""


class PaymentProcessor(StatefulProcessor):
    """Keyed by account (records that are not a payment: by a negative key per partition, and
    passed on as ``dead`` rows). Per batch, in Kafka offset order: add each payment to the balance
    (ValueState), and split them into
    on-time (added to their minute's total, MapState) and late (older than the account's
    watermark, emitted as ``late``). Emits one ``balance`` row per account and one ``total``
    row per minute touched in the batch; minutes the watermark has passed are final and
    evicted. Runs in Spark's Python workers; every decision depends only on the log order."""

    def __init__(self, allowed_lateness_ms: int) -> None:
        self.allowed_lateness_ms = allowed_lateness_ms

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.balance = handle.getValueState("balance", "balance_cents bigint, events bigint")
        self.clock = handle.getValueState("clock", "max_event_ms bigint")
        self.minutes = handle.getMapState("minutes", "minute_ms bigint", "total_cents bigint, events bigint")

    def handleInputRows(self, key: Any, rows: Iterator[Any], timerValues: TimerValues) -> Iterator[Any]:
        account = key[0]
        stored_balance, stored_clock = self.balance.get(), self.clock.get()
        balance, events = (stored_balance[0], stored_balance[1]) if stored_balance else (0, 0)
        clock = stored_clock[0] if stored_clock else None
        touched: dict[int, tuple[int, int]] = {}
        empty = dict.fromkeys(("account_id", "balance_cents", "events", "minute_ms", "total_cents", "event_id",
                               "amount_cents", "event_ms", "watermark_ms", "kafka_partition", "kafka_offset", "raw",
                               "reason"))
        for row in sorted(rows, key=lambda r: (r.kafka_partition, r.kafka_offset)):
            if row.reason is not None:
                yield Row(**{**empty, "kind": "dead", "kafka_partition": row.kafka_partition,
                             "kafka_offset": row.kafka_offset, "raw": row.raw, "reason": row.reason})
                continue
            balance, events = balance + row.amount_cents, events + 1
            watermark = None if clock is None else clock - self.allowed_lateness_ms
            if watermark is not None and row.event_ms < watermark:
                yield Row(**{**empty, "kind": "late", "account_id": account, "event_id": row.event_id,
                             "amount_cents": row.amount_cents, "event_ms": row.event_ms, "watermark_ms": watermark})
            else:
                minute = row.event_ms // 60_000 * 60_000
                if minute not in touched:
                    stored = self.minutes.getValue((minute,))
                    touched[minute] = (stored[0], stored[1]) if stored else (0, 0)
                total, count = touched[minute]
                touched[minute] = (total + row.amount_cents, count + 1)
            clock = row.event_ms if clock is None else max(clock, row.event_ms)
        if clock is None:
            return
        self.balance.update((balance, events))
        self.clock.update((clock,))
        yield Row(**{**empty, "kind": "balance", "account_id": account, "balance_cents": balance, "events": events})
        for minute, (total, count) in sorted(touched.items()):
            self.minutes.updateValue((minute,), (total, count))
            yield Row(**{**empty, "kind": "total", "account_id": account, "minute_ms": minute,
                         "total_cents": total, "events": count})
        watermark = clock - self.allowed_lateness_ms
        for (minute,) in list(self.minutes.keys()):
            if minute + 60_000 <= watermark:
                self.minutes.removeKey((minute,))

    def close(self) -> None:
        pass

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
dropped before, in the JVM (see :meth:`ReferencePipeline.processed`), and the processor reads
and writes its state (balance, clock and open minutes in one ValueState) once per account and
batch, never once per event or minute.

Balances count every unique well-formed payment, late ones included (money is money); only
the per-minute totals leave late payments out, and the side output lists them.
"""

from __future__ import annotations

import json
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
    passed on as ``dead`` rows). Per batch, in Kafka offset order: add each payment to the
    balance, and split them into on-time (added to their minute's total) and late (older than
    the account's watermark, emitted as ``late``). Emits one ``balance`` row per account and one
    ``total`` row per minute touched in the batch; minutes the watermark has passed are final and
    leave the state. The account's whole state (balance, clock, open minutes) is one ValueState,
    read once and written once per batch: a state call costs a round trip to the JVM, and per
    minute or per payment those round trips were most of the pipeline's time. Runs in Spark's
    Python workers; every decision depends only on the log order."""

    def __init__(self, allowed_lateness_ms: int) -> None:
        self.allowed_lateness_ms = allowed_lateness_ms

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.account = handle.getValueState(
            "account", "balance_cents bigint, events bigint, max_event_ms bigint, open_minutes string")

    def handleInputRows(self, key: Any, rows: Iterator[Any], timerValues: TimerValues) -> Iterator[Any]:
        account = key[0]
        stored = self.account.get()
        balance, events, clock = (stored[0], stored[1], stored[2]) if stored else (0, 0, None)
        # {minute_ms: [total_cents, events]} of the minutes the watermark has not passed yet
        minutes: dict[int, list[int]] = {int(m): v for m, v in json.loads(stored[3]).items()} if stored else {}
        touched: set[int] = set()
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
                total = minutes.setdefault(minute, [0, 0])
                total[0], total[1] = total[0] + row.amount_cents, total[1] + 1
                touched.add(minute)
            clock = row.event_ms if clock is None else max(clock, row.event_ms)
        if clock is None:
            return
        yield Row(**{**empty, "kind": "balance", "account_id": account, "balance_cents": balance, "events": events})
        for minute in sorted(touched):
            yield Row(**{**empty, "kind": "total", "account_id": account, "minute_ms": minute,
                         "total_cents": minutes[minute][0], "events": minutes[minute][1]})
        watermark = clock - self.allowed_lateness_ms
        still_open = {m: v for m, v in minutes.items() if m + 60_000 > watermark}
        self.account.update((balance, events, clock, json.dumps(still_open)))

    def close(self) -> None:
        pass

"""The reference pipeline's stateful step (:class:`oncekit.reference.processor.PaymentProcessor`)
without Spark: its ``handleInputRows`` driven directly with pandas frames as
transformWithStateInPandas hands them over, its ValueState replaced by a dict-backed fake."""

from __future__ import annotations

import json
import random
from typing import Any

import numpy as np
import pandas as pd
import pytest

pytest.importorskip("pyspark")
from oncekit.reference.processor import PaymentProcessor  # noqa: E402

LATENESS_MS = 10_000
M = 1_700_000_040_000  # a minute's start
COLUMNS = ("group_key", "event_id", "amount_cents", "event_ms", "kafka_partition", "kafka_offset", "raw", "reason")
OUTPUT = ("kind", "account_id", "balance_cents", "events", "minute_ms", "total_cents", "event_id", "amount_cents",
          "event_ms", "watermark_ms", "kafka_partition", "kafka_offset", "raw", "reason")


class FakeValueState:
    """The ValueState calls the processor may make, counted."""

    def __init__(self) -> None:
        self.value: tuple[Any, ...] | None = None
        self.calls = 0

    def exists(self) -> bool:
        self.calls += 1
        return self.value is not None

    def get(self) -> tuple[Any, ...] | None:
        self.calls += 1
        return self.value

    def update(self, value: tuple[Any, ...]) -> None:
        self.calls += 1
        assert all(type(v) in (int, str) for v in value), value  # what Spark's LongType/StringType take
        self.value = tuple(value)

    def clear(self) -> None:
        self.calls += 1
        self.value = None


class Keyed:
    """One processor per grouping key with its own state, as Spark keeps state per key."""

    def __init__(self) -> None:
        self.states: dict[int, FakeValueState] = {}

    def run(self, key: int, *frames: pd.DataFrame) -> list[dict[str, Any]]:
        state = self.states.setdefault(key, FakeValueState())
        processor = PaymentProcessor(LATENESS_MS)
        processor.account = state  # type: ignore[assignment]  # what init() gets from the handle
        before = state.calls
        out = list(processor.handleInputRows((key,), iter(frames), None))  # type: ignore[arg-type]
        assert state.calls - before <= 2  # one get, at most one update
        assert len(out) <= 1  # one frame per key and batch
        return [row for frame in out for row in records(frame)]


def records(frame: pd.DataFrame) -> list[dict[str, Any]]:
    """The rows of an output frame with NULL as None and numbers as int, read as the worker
    converts it to Arrow (the columns by position: the frame's labels are their positions)."""
    assert list(frame.columns) == list(range(len(OUTPUT)))
    from pyspark.sql.conversion import PandasToArrowConversion
    from pyspark.sql.types import IntegerType, LongType, StringType, StructField, StructType

    from oncekit.reference.processor import PROCESSED_SCHEMA

    types = {"string": StringType(), "bigint": LongType(), "int": IntegerType()}  # the DDL without a JVM
    schema = StructType([StructField(name, types[kind]) for name, kind in
                         (field.split() for field in PROCESSED_SCHEMA.split(","))])
    batch = PandasToArrowConversion.convert([frame], StructType([StructField("_0", schema)]), arrow_cast=True,
                                            assign_cols_by_name=True)
    return [dict(row) for row in batch.column(0).to_pylist()]


def row(kind: str, **values: Any) -> dict[str, Any]:
    return {**dict.fromkeys(OUTPUT), "kind": kind, **values}


def frame(rows: list[tuple[Any, ...]], floats: bool = False) -> pd.DataFrame:
    """Input rows as Spark hands them over: numbers int64, or float64 (NaN for NULL) when the
    Arrow batch they came from had a NULL in the column."""
    out = pd.DataFrame(rows, columns=list(COLUMNS))
    if floats:
        out = out.astype({"amount_cents": "float64", "event_ms": "float64"})
    return out


def pay(account: int, event_id: str, amount: int, event_ms: int, offset: int, partition: int = 0) -> tuple[Any, ...]:
    return (account, event_id, amount, event_ms, partition, offset, f'{{"event_id": "{event_id}"}}', None)


def bad(partition: int, offset: int, raw: str, reason: str, event_id: str | None = None) -> tuple[Any, ...]:
    return (-1 - partition, event_id, None, None, partition, offset, raw, reason)


def by_kind(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(rows, key=lambda r: (r["kind"], r["kafka_offset"] or 0, r["minute_ms"] or 0, r["event_id"] or ""))


def test_two_batches_late_payments_minutes_and_dead_rows() -> None:
    keyed = Keyed()
    # batch 1, rows out of log order: e3 is late (clock M+65 s, watermark M+55 s); e4 sits on
    # the watermark and is on time; e1 is the account's first payment (no clock before it)
    first = keyed.run(7, frame([
        pay(7, "e3", 50, M + 50_000, 12), pay(7, "e1", 100, M + 5_000, 10),
        pay(7, "e4", 25, M + 55_000, 13), pay(7, "e2", 200, M + 65_000, 11)]))
    assert first == [
        row("late", account_id=7, event_id="e3", amount_cents=50, event_ms=M + 50_000, watermark_ms=M + 55_000),
        row("balance", account_id=7, balance_cents=375, events=4),
        row("total", account_id=7, minute_ms=M, total_cents=125, events=2),
        row("total", account_id=7, minute_ms=M + 60_000, total_cents=200, events=1),
    ]
    balance, events, clock, open_minutes = keyed.states[7].value or ()
    assert (balance, events, clock) == (375, 4, M + 65_000)
    assert json.loads(open_minutes) == {str(M): [125, 2], str(M + 60_000): [200, 1]}

    # dead rows: their own group, passed on in log order, their parsed fields dropped
    dead = keyed.run(-1, frame([bad(0, 15, "{]", "not a JSON object"),
                                bad(0, 14, '{"event_id": "x"}', "account_id missing or not an integer", "x")]))
    assert dead == [
        row("dead", kafka_partition=0, kafka_offset=14, raw='{"event_id": "x"}',
            reason="account_id missing or not an integer"),
        row("dead", kafka_partition=0, kafka_offset=15, raw="{]", reason="not a JSON object"),
    ]
    assert keyed.states[-1].value is None  # no account state for dead rows

    # batch 2 in two frames (a key's rows may span several), floats as Spark gives them when
    # the Arrow batch had NULLs: e5 moves the clock to M+130 s, so e6 is late against the
    # watermark M+120 s and e7 (M+121 s) is on time
    second = keyed.run(7, frame([pay(7, "e7", 3, M + 121_000, 18), pay(7, "e5", 10, M + 130_000, 16)], floats=True),
                       frame([pay(7, "e6", 1, M + 59_000, 17)], floats=True))
    assert second == [
        row("late", account_id=7, event_id="e6", amount_cents=1, event_ms=M + 59_000, watermark_ms=M + 120_000),
        row("balance", account_id=7, balance_cents=389, events=7),
        row("total", account_id=7, minute_ms=M + 120_000, total_cents=13, events=2),
    ]
    # minutes M and M+60 s end at or before the watermark M+120 s: final, out of the state
    balance, events, clock, open_minutes = keyed.states[7].value or ()
    assert (balance, events, clock) == (389, 7, M + 130_000)
    assert json.loads(open_minutes) == {str(M + 120_000): [13, 2]}

    # batch 3: an open minute's total goes on from the state
    third = keyed.run(7, frame([pay(7, "e8", 5, M + 125_000, 19)]))
    assert third == [row("balance", account_id=7, balance_cents=394, events=8),
                     row("total", account_id=7, minute_ms=M + 120_000, total_cents=18, events=3)]


def test_no_payment_no_state_and_no_output() -> None:
    keyed = Keyed()
    assert keyed.run(3) == []
    assert keyed.states[3].value is None


def reference(batches: list[list[tuple[Any, ...]]], lateness_ms: int) -> list[list[dict[str, Any]]]:
    """The processor's rules one row at a time (the former row-API processor), per batch of
    one account's rows."""
    balance, events, clock, outs = 0, 0, None, []
    minutes: dict[int, list[int]] = {}
    for rows in batches:
        out: list[dict[str, Any]] = []
        touched: set[int] = set()
        for r in sorted(rows, key=lambda r: (r[4], r[5])):
            account, event_id, amount, event_ms, partition, offset, raw, reason = r
            if reason is not None:
                out.append(row("dead", kafka_partition=partition, kafka_offset=offset, raw=raw, reason=reason))
                continue
            balance, events = balance + amount, events + 1
            watermark: int | None = None if clock is None else clock - lateness_ms
            if watermark is not None and event_ms < watermark:
                out.append(row("late", account_id=account, event_id=event_id, amount_cents=amount, event_ms=event_ms,
                               watermark_ms=watermark))
            else:
                minute = event_ms // 60_000 * 60_000
                total = minutes.setdefault(minute, [0, 0])
                total[0], total[1] = total[0] + amount, total[1] + 1
                touched.add(minute)
            clock = event_ms if clock is None else max(clock, event_ms)
        if clock is not None:
            out.append(row("balance", account_id=rows[0][0], balance_cents=balance, events=events))
            out += [row("total", account_id=rows[0][0], minute_ms=m, total_cents=minutes[m][0], events=minutes[m][1])
                    for m in sorted(touched)]
            minutes = {m: v for m, v in minutes.items() if m + 60_000 > clock - lateness_ms}
        outs.append(out)
    return outs


@pytest.mark.parametrize("seed", range(5))
def test_same_rows_as_one_row_at_a_time(seed: int) -> None:
    rng = random.Random(seed)
    keyed = Keyed()
    for account in range(3):
        clock, log = M, []
        for offset in range(300):
            clock += rng.randrange(0, 4_000)
            late = rng.random() < 0.1
            log.append(pay(account, f"{account}-{offset}", rng.randrange(-500, 5_000),
                           clock - (rng.randrange(10_000, 200_000) if late else rng.randrange(0, 8_000)), offset))
        cuts = sorted(rng.sample(range(1, len(log)), 6))
        batches = [log[a:b] for a, b in zip([0, *cuts], [*cuts, len(log)])]
        for batch, want in zip(batches, reference(batches, LATENESS_MS)):
            shuffled = rng.sample(batch, len(batch))
            pieces = np.array_split(np.arange(len(shuffled)), rng.randrange(1, 4))
            got = keyed.run(account, *(frame([shuffled[i] for i in piece], floats=rng.random() < 0.5)
                                       for piece in pieces if len(piece)))
            assert got == want

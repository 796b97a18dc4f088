"""The reference pipeline's stateful step (:class:`oncekit.reference.processor.PaymentProcessor`)
without Spark: called with pandas frames as applyInPandasWithState hands them over (a bucket's
rows of a batch in any order, in one or several frames), its GroupState replaced by a fake, and
its output checked against the rules applied one row at a time (the former row-API processor,
per account)."""

from __future__ import annotations

import json
import random
import warnings
from typing import Any

import numpy as np
import pandas as pd
import pytest

from oncekit.reference.processor import GIVEN, INPUT_COLUMNS, OUTPUT_COLUMNS, BucketState, PaymentProcessor

LATENESS_MS = 10_000
M = 1_700_000_040_000  # a minute's start
OUTPUT = tuple(name for name, _ in OUTPUT_COLUMNS)


class FakeGroupState:
    """The GroupState calls the processor may make, counted; values kept as Spark would return
    them (a tuple of lists)."""

    def __init__(self) -> None:
        self.value: tuple[Any, ...] | None = None
        self.calls = 0

    @property
    def exists(self) -> bool:
        return self.value is not None

    @property
    def get(self) -> tuple[Any, ...]:
        self.calls += 1
        assert self.value is not None, "GroupState.get of a group without state raises in Spark"
        return self.value

    def update(self, value: tuple[Any, ...]) -> None:
        self.calls += 1
        assert len(value) == 1 and type(value[0]) is bytes, value  # STATE_SCHEMA: one binary column
        self.value = value


class Bucketed:
    """One processor call per grouping key with its own state, as Spark keeps state per key."""

    def __init__(self) -> None:
        self.states: dict[int, FakeGroupState] = {}

    def run(self, key: int, *frames: pd.DataFrame) -> list[dict[str, Any]]:
        state = self.states.setdefault(key, FakeGroupState())
        before = state.calls
        out = list(PaymentProcessor(LATENESS_MS)((key,), iter(frames), state))  # type: ignore[arg-type]
        assert state.calls - before <= 2  # one get, at most one update
        assert len(out) <= 1  # one frame per key and batch
        return [row for frame in out for row in records(frame)]


def stored(bucketed: Bucketed, key: int) -> tuple[list[int], ...]:
    """A bucket's stored state, column by column (accounts, balances, events, clocks, then the
    open minutes' accounts, minutes, totals and counts)."""
    state = BucketState.load(bucketed.states[key].value)
    return tuple(column.tolist() for column in (state.accounts, state.balances, state.events, state.clocks,
                                                state.minute_accounts, state.minutes, state.minute_totals,
                                                state.minute_events))


def records(frame: pd.DataFrame) -> list[dict[str, Any]]:
    """The rows of an output frame with NULL as None and numbers as int: read as the worker
    converts it to Arrow (the columns by name), then unpacked as the pipeline's route does in
    the JVM (each column NULL where its row's kind does not give it)."""
    assert list(frame.columns) == list(OUTPUT) and len(frame) == 1  # one packed row per call
    # as PySpark 4.3's worker does: the batch's frames concatenated, by label, with padding rows
    # of its own labelled by the schema's names (pandas warns of that concatenation's future)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        frame = pd.concat([frame, pd.DataFrame(dict.fromkeys(OUTPUT), index=[])], ignore_index=True)
    from pyspark.sql.conversion import PandasToArrowConversion
    from pyspark.sql.types import ArrayType, IntegerType, LongType, StringType, StructField, StructType

    types = {"string": StringType(), "bigint": LongType(), "int": IntegerType()}  # the DDL without a JVM
    schema = StructType([StructField(name, ArrayType(types[kind])) for name, kind in OUTPUT_COLUMNS])
    batch = PandasToArrowConversion.convert([frame], StructType([StructField("_0", schema)]), arrow_cast=True,
                                            assign_cols_by_name=True)
    (columns,) = batch.column(0).to_pylist()
    rows = [dict(zip(OUTPUT, values)) for values in zip(*(columns[name] for name in OUTPUT))]
    return [{name: value if name == "kind" or name in GIVEN[r["kind"]] else None for name, value in r.items()}
            for r in rows]


def row(kind: str, **values: Any) -> dict[str, Any]:
    return {**dict.fromkeys(OUTPUT), "kind": kind, **values}


def frame(rows: list[tuple[Any, ...]]) -> pd.DataFrame:
    """Input rows as Spark hands them over: ``INPUT_COLUMNS`` and the grouping key first."""
    return pd.DataFrame(rows, columns=["group_key", *INPUT_COLUMNS])


def pay(account: int, event_id: str, amount: int, event_ms: int, offset: int, partition: int = 0) -> tuple[Any, ...]:
    return (account % 4, account, event_id, amount, event_ms, partition, offset, f'{{"event_id": "{event_id}"}}', None)


def bad(partition: int, offset: int, raw: str, reason: str, event_id: str | None = None) -> tuple[Any, ...]:
    return (-1 - partition, 0, event_id, 0, 0, partition, offset, raw, reason)


def canonical(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows in one order whatever the processor's: the output is a set of facts of the batch."""
    return sorted(rows, key=lambda r: json.dumps(r, sort_keys=True))


def test_two_batches_late_payments_minutes_and_dead_rows() -> None:
    bucketed = Bucketed()
    # batch 1, rows out of log order, accounts 7 and 3 in one bucket: e3 is late (clock M+65 s,
    # watermark M+55 s); e4 sits on the watermark and is on time; e1 is account 7's first
    # payment (no clock before it); account 3's payment at M is on time (its own clock)
    first = bucketed.run(3, frame([
        pay(7, "e3", 50, M + 50_000, 12), pay(7, "e1", 100, M + 5_000, 10), pay(3, "a1", 9, M, 14),
        pay(7, "e4", 25, M + 55_000, 13), pay(7, "e2", 200, M + 65_000, 11)]))
    assert canonical(first) == canonical([
        row("late", account_id=7, event_id="e3", amount_cents=50, event_ms=M + 50_000, watermark_ms=M + 55_000),
        row("balance", account_id=3, balance_cents=9, events=1),
        row("balance", account_id=7, balance_cents=375, events=4),
        row("total", account_id=3, minute_ms=M, total_cents=9, events=1),
        row("total", account_id=7, minute_ms=M, total_cents=125, events=2),
        row("total", account_id=7, minute_ms=M + 60_000, total_cents=200, events=1),
    ])
    accounts, balances, events, clocks, minute_accounts, minutes, totals, counts = stored(bucketed, 3)
    assert (accounts, balances, events, clocks) == ([3, 7], [9, 375], [1, 4], [M, M + 65_000])
    assert list(zip(minute_accounts, minutes, totals, counts)) == [
        (3, M, 9, 1), (7, M, 125, 2), (7, M + 60_000, 200, 1)]

    # dead rows: their own group, passed on in log order, no state
    dead = bucketed.run(-1, frame([bad(0, 15, "{]", "not a JSON object"),
                                   bad(0, 14, '{"event_id": "x"}', "account_id missing or not an integer", "x")]))
    assert dead == [
        row("dead", kafka_partition=0, kafka_offset=14, raw='{"event_id": "x"}',
            reason="account_id missing or not an integer"),
        row("dead", kafka_partition=0, kafka_offset=15, raw="{]", reason="not a JSON object"),
    ]
    assert bucketed.states[-1].value is None and bucketed.states[-1].calls == 0

    # batch 2 in two frames (a key's rows may span several): e5 moves 7's clock to M+130 s, so
    # e6 is late against the watermark M+120 s and e7 (M+121 s) is on time; account 3 has no
    # payment and keeps its state
    second = bucketed.run(3, frame([pay(7, "e7", 3, M + 121_000, 18), pay(7, "e5", 10, M + 130_000, 16)]),
                          frame([pay(7, "e6", 1, M + 59_000, 17)]))
    assert canonical(second) == canonical([
        row("late", account_id=7, event_id="e6", amount_cents=1, event_ms=M + 59_000, watermark_ms=M + 120_000),
        row("balance", account_id=7, balance_cents=389, events=7),
        row("total", account_id=7, minute_ms=M + 120_000, total_cents=13, events=2),
    ])
    # 7's minutes M and M+60 s end at or before its watermark M+120 s: final, out of the state
    accounts, balances, events, clocks, minute_accounts, minutes, totals, counts = stored(bucketed, 3)
    assert (accounts, balances, events, clocks) == ([3, 7], [9, 389], [1, 7], [M, M + 130_000])
    assert list(zip(minute_accounts, minutes, totals, counts)) == [(3, M, 9, 1), (7, M + 120_000, 13, 2)]

    # batch 3: an open minute's total goes on from the state
    third = bucketed.run(3, frame([pay(7, "e8", 5, M + 125_000, 19)]))
    assert canonical(third) == canonical([row("balance", account_id=7, balance_cents=394, events=8),
                                          row("total", account_id=7, minute_ms=M + 120_000, total_cents=18, events=3)])


def test_no_rows_no_state_and_no_output() -> None:
    bucketed = Bucketed()
    assert bucketed.run(3) == []
    assert bucketed.states[3].value is None


def test_large_amounts_stay_exact() -> None:
    big = 2**62 + 1
    got = Bucketed().run(1, frame([pay(5, "x", big, M, 0), pay(5, "y", -3, M + 1, 1)]))
    assert row("balance", account_id=5, balance_cents=big - 3, events=2) in got


def reference(batches: list[list[tuple[Any, ...]]], lateness_ms: int) -> list[list[dict[str, Any]]]:
    """The processor's rules one row at a time, per account, as the row-API processor applied
    them; the output of each batch."""
    balances: dict[int, tuple[int, int]] = {}
    clocks: dict[int, int] = {}
    minutes: dict[int, dict[int, list[int]]] = {}
    outs = []
    for rows in batches:
        out: list[dict[str, Any]] = []
        touched: dict[int, set[int]] = {}
        for r in sorted(rows, key=lambda r: (r[1], r[5], r[6])):
            _, account, event_id, amount, event_ms, partition, offset, raw, reason = r
            if reason is not None:
                out.append(row("dead", kafka_partition=partition, kafka_offset=offset, raw=raw, reason=reason))
                continue
            balance, events = balances.get(account, (0, 0))
            balances[account] = (balance + amount, events + 1)
            clock = clocks.get(account)
            watermark = None if clock is None else clock - lateness_ms
            if watermark is not None and event_ms < watermark:
                out.append(row("late", account_id=account, event_id=event_id, amount_cents=amount, event_ms=event_ms,
                               watermark_ms=watermark))
            else:
                minute = event_ms // 60_000 * 60_000
                total = minutes.setdefault(account, {}).setdefault(minute, [0, 0])
                total[0], total[1] = total[0] + amount, total[1] + 1
                touched.setdefault(account, set()).add(minute)
            clocks[account] = event_ms if clock is None else max(clock, event_ms)
        for account in sorted({r[1] for r in rows if r[8] is None}):
            out.append(row("balance", account_id=account, balance_cents=balances[account][0],
                           events=balances[account][1]))
            held = minutes.get(account, {})
            out += [row("total", account_id=account, minute_ms=m, total_cents=held[m][0], events=held[m][1])
                    for m in sorted(touched.get(account, ()))]
            minutes[account] = {m: v for m, v in held.items() if m + 60_000 > clocks[account] - lateness_ms}
        outs.append(out)
    return outs


@pytest.mark.parametrize("seed", range(6))
def test_same_rows_as_one_row_at_a_time(seed: int) -> None:
    """Several accounts interleaved in one bucket over two partitions, random late payments,
    minutes that close and reopen, dead rows mixed in, any batch cuts, rows shuffled and split
    into frames: the same output as the rules applied one row at a time."""
    rng = random.Random(seed)
    log: list[tuple[Any, ...]] = []
    clock = {account: M + rng.randrange(0, 100_000) for account in (1, 5, 9, -3)}
    offsets = [0, 0]
    for _ in range(600):
        account = rng.choice(list(clock))
        partition = account % 2
        offsets[partition] += 1
        if rng.random() < 0.05:
            log.append(bad(partition, offsets[partition], "{", "not a JSON object"))
            continue
        clock[account] += rng.randrange(0, 15_000)
        late = rng.random() < 0.1
        event_ms = clock[account] - (rng.randrange(10_000, 200_000) if late else rng.randrange(0, 12_000))
        log.append(pay(account, f"{account}-{len(log)}", rng.randrange(-500, 5_000), event_ms, offsets[partition],
                       partition))
    cuts = sorted(rng.sample(range(1, len(log)), 8))
    batches = [log[a:b] for a, b in zip([0, *cuts], [*cuts, len(log)])]
    bucketed = Bucketed()
    for batch, want in zip(batches, reference(batches, LATENESS_MS)):
        shuffled = rng.sample(batch, len(batch))
        pieces = np.array_split(np.arange(len(shuffled)), rng.randrange(1, 4))
        got = bucketed.run(1, *(frame([shuffled[i] for i in piece]) for piece in pieces if len(piece)))
        assert canonical(got) == canonical(want)

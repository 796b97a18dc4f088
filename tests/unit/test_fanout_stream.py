"""The fan-out task routes its input to its targets as it streams in: pure logic, with in-memory
targets (the fan-out's exactly-once under crashes is proven on real services in
tests/eos/test_fanout.py)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pytest

from oncekit.core.errors import ConfigError, TaskInputCutError
from oncekit.core.fanout import QUEUED, FanOutSink, fan_out
from oncekit.core.bases import TwoPhaseCommitSink
from oncekit.core.protocol import CommitOutcome, Committable, DeliveryGuarantee, TaskInfo
from oncekit.sinks.postgres import postgres_sink

ROUTES = ("a", "b", "c")


class Target(TwoPhaseCommitSink[TaskInfo]):
    """Keeps what it was written; pre-commits one committable; optionally fails at a batch, or
    waits for ``gate`` before taking each batch (a slow target)."""

    guarantee = DeliveryGuarantee.EXACTLY_ONCE

    def __init__(self, sink_id: str, fail_at: int | None = None, gate: threading.Event | None = None) -> None:
        self.sink_id, self.fail_at, self.gate = sink_id, fail_at, gate
        self.rows: list[int] = []
        self.batches = 0
        self.aborted = self.prepared = False

    def begin_transaction(self, task: TaskInfo) -> TaskInfo:
        return task

    def write(self, transaction: TaskInfo, batch: Any) -> None:
        if self.fail_at == self.batches:
            raise RuntimeError(f"{self.sink_id} refused batch {self.batches}")
        self.batches += 1
        self.rows += batch.column(0).to_pylist()

    def pre_commit(self, transaction: TaskInfo) -> Committable:
        self.prepared = True
        return Committable(self.sink_id, transaction.batch_id, transaction.partition_id, transaction.attempt,
                           len(self.rows), transaction_id=transaction.transaction_id)

    def abort_open(self, transaction: TaskInfo) -> None:
        self.aborted = True

    def commit(self, committable: Committable) -> CommitOutcome:
        return CommitOutcome.COMMITTED

    def abort(self, committable: Committable) -> CommitOutcome:
        return CommitOutcome.ABORTED

    def write_partition(self, task: TaskInfo, batches: Iterator[pa.RecordBatch]) -> list[Committable]:
        if self.gate is not None:
            batches = (batch for batch in batches if self.gate.wait(30))
        return super().write_partition(task, batches)


def sink(**targets: Target) -> FanOutSink:
    config = fan_out({route: postgres_sink("postgresql://test@localhost/test", f"table_{route}", "two-phase-commit",
                                           sink_id=target.sink_id, columns=("id",))
                      for route, target in targets.items()})
    return FanOutSink(config, targets)


def batch(ids: range, routes: list[str] | None = None) -> pa.RecordBatch:
    return pa.RecordBatch.from_pydict({"id": list(ids), "target": routes or [ROUTES[i % 3] for i in ids]})


TASK = TaskInfo("fanout", batch_id=7, partition_id=1, attempt=3)


def test_each_target_gets_its_rows_in_order_and_the_task_returns_every_committable() -> None:
    targets = {route: Target(f"s-{route}") for route in ROUTES}
    committables = sink(**targets).write_partition(TASK, iter([batch(range(0, 30)), batch(range(30, 60))]))
    for index, route in enumerate(ROUTES):
        assert targets[route].rows == list(range(index, 60, 3))
        assert targets[route].prepared and not targets[route].aborted
    assert [c.sink_id for c in committables] == ["s-a", "s-b", "s-c"]
    assert {(c.batch_id, c.partition_id, c.attempt) for c in committables} == {(7, 1, 3)}


def test_a_task_holds_a_few_batches_per_target_not_its_partition() -> None:
    gate = threading.Event()
    slow = Target("s-a", gate=gate)
    fanned = sink(a=slow, b=Target("s-b"), c=Target("s-c"))
    taken = 0

    def input_batches() -> Iterator[pa.RecordBatch]:
        nonlocal taken
        for start in range(0, 3000, 30):
            taken += 1
            yield batch(range(start, start + 30))

    task = threading.Thread(target=fanned.write_partition, args=(TASK, input_batches()))
    task.start()
    task.join(1.0)
    # The slow target holds one batch (waiting at its gate), its feed QUEUED more, and the task
    # one it waits to hand over: nothing else of the partition has been read.
    assert task.is_alive() and taken <= QUEUED + 2
    gate.set()
    task.join(30)
    assert not task.is_alive() and slow.rows == list(range(0, 3000, 3))


def test_a_failing_target_stops_the_others_and_the_task_raises_its_error() -> None:
    targets = {"a": Target("s-a"), "b": Target("s-b", fail_at=1), "c": Target("s-c")}
    with pytest.raises(RuntimeError, match="s-b refused batch 1"):
        sink(**targets).write_partition(TASK, iter([batch(range(i, i + 30)) for i in range(0, 3000, 30)]))
    assert all(target.aborted and not target.prepared for target in targets.values())


def test_an_unknown_route_mid_partition_aborts_every_target_naming_sink_batch_partition_and_route() -> None:
    targets = {route: Target(f"s-{route}") for route in ROUTES}
    fanned = sink(**targets)
    with pytest.raises(ConfigError, match=rf"sink {fanned.sink_id} batch 7 partition 1: rows routed to \['x'\]"):
        fanned.write_partition(TASK, iter([batch(range(0, 3)), batch(range(3, 5), ["a", "x"])]))
    assert all(target.aborted and not target.prepared for target in targets.values())


def test_an_input_cut_reaches_every_target_as_task_input_cut() -> None:
    seen: list[BaseException] = []

    class Watching(Target):
        def write_partition(self, task: TaskInfo, batches: Iterator[pa.RecordBatch]) -> list[Committable]:
            try:
                return super().write_partition(task, batches)
            except BaseException as exc:
                seen.append(exc)
                raise

    def cut() -> Iterator[pa.RecordBatch]:
        yield batch(range(0, 3))
        raise OSError("Spark stopped the input")

    with pytest.raises(OSError, match="Spark stopped the input"):
        sink(a=Watching("s-a"), b=Watching("s-b"), c=Watching("s-c")).write_partition(TASK, cut())
    assert len(seen) == 3 and all(isinstance(exc, TaskInputCutError) for exc in seen)


def test_a_null_route_is_refused_as_naming_no_target() -> None:
    targets = {route: Target(f"s-{route}") for route in ROUTES}
    fanned = sink(**targets)
    with pytest.raises(ConfigError, match=r"rows routed to \[None\]"):
        fanned.write_partition(TASK, iter([batch(range(0, 2), ["a", None])]))

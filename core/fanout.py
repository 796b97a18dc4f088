"""One checkpoint, many sinks: one query's output routed by a column to several sinks of any
protocol, as a Flink job has one checkpoint across all its sinks.

Spark writes a query to one sink, so without this a job with N outputs runs N queries, each
reading its source and computing its state again. Here one stream writer takes every row; a row
goes to the target its ``route_column`` names, with that target's columns. The commit sequence
of batch N:

1. Each task routes its partition's Arrow batches to the targets as they stream in; every
   target writes its part by its own protocol (pre-commit for two-phase commit, stage for the
   write-ahead log, commit with a marker for the task-commit and idempotent protocols) in a
   thread of its own, side by side with the others, and the task returns the committables of
   all targets.
2. The driver journals them in ONE journal entry (the fan-out's), before Spark logs batch N, and
   each target whose protocol needs it makes the decision final at its target.
3. Checkpoint-complete commits each target's committables by its own protocol, target after
   target; recovery commits or aborts per target as for a single sink (the engine drives each
   target, :meth:`FanOutSink.targets`).

One epoch for the whole query run: the first exactly-once target (by sink id) takes it, each
other target holds it (:meth:`FanOutSink.take_epoch`), so every target refuses the same older
runs.

Exactly-once holds per target. Visibility across targets is not atomic (as in Flink): after a
crash between two targets' commits, one target shows batch N before the other does.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import logging
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import pyarrow as pa
import pyarrow.compute as pc

from oncekit.core import parallel
from oncekit.core.errors import ConfigError, TaskInputCutError
from oncekit.core.protocol import Committable, DeliveryGuarantee, Sink, SinkConfig, SinkOwner, TaskInfo

logger = logging.getLogger(__name__)
T = TypeVar("T")

FORMAT = "oncekit-fanout"


@dataclass(frozen=True)
class FanOutConfig(SinkConfig):
    """``targets`` maps each route value to a sink configuration whose ``columns`` name what the
    target gets (its config's ``columns`` field; every column but the route column when empty).
    Build it with :func:`fan_out`."""

    format_name: ClassVar[str] = FORMAT

    targets: Mapping[str, SinkConfig]
    route_column: str = "target"
    sink_id: str = ""
    protocol: str = "fan-out"
    columns: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if not self.targets:
            raise ConfigError(f"{FORMAT}: give at least one target")
        ids = [config.sink_id for config in self.targets.values()]
        if len(set(ids)) != len(ids):
            raise ConfigError(f"{FORMAT}: target sink ids must differ (they name transactions and journals); got {ids}")
        # A default id from the targets' ids: the same targets give the same journal folder.
        digest = hashlib.sha1(",".join(sorted(ids)).encode()).hexdigest()[:12]
        self._check_common(("fan-out",), ",".join(self.targets), f"fanout-{digest}")
        if self.columns and self.route_column not in self.columns:
            raise ConfigError(f"{FORMAT} sink {self.sink_id}: the stream has no route column {self.route_column!r}; "
                              f"it has {', '.join(self.columns)}")

    def __repr__(self) -> str:
        return f"FanOutConfig(sink_id={self.sink_id!r}, route_column={self.route_column!r}, targets={dict(self.targets)!r})"

    @property
    def guarantee(self) -> DeliveryGuarantee:
        guarantees = {config.guarantee for config in self.targets.values()}
        return DeliveryGuarantee.EXACTLY_ONCE if guarantees == {DeliveryGuarantee.EXACTLY_ONCE} else DeliveryGuarantee.AT_LEAST_ONCE

    def target_columns(self, route: str) -> tuple[str, ...]:
        declared = tuple(getattr(self.targets[route], "columns", ()) or ())
        return declared or tuple(c for c in self.columns if c != self.route_column)

    def to_options(self) -> dict[str, str]:
        targets = [
            {"route": route, "config": f"{type(config).__module__}:{type(config).__qualname__}",
             "options": config.to_options(), "columns": list(self.target_columns(route))}
            for route, config in self.targets.items()
        ]
        return {"targets": json.dumps(targets), "routecolumn": self.route_column, "sinkid": self.sink_id}

    @classmethod
    def from_options(cls, options: Mapping[str, str], columns: tuple[str, ...]) -> FanOutConfig:
        get = {k.lower(): v for k, v in options.items()}.get
        targets: dict[str, SinkConfig] = {}
        for target in json.loads(get("targets") or "[]"):
            module, _, name = target["config"].partition(":")
            config_type = getattr(importlib.import_module(module), name)
            targets[target["route"]] = config_type.from_options(target["options"], tuple(target["columns"]))
        return cls(targets=targets, route_column=get("routecolumn", "target"), sink_id=get("sinkid", ""), columns=columns)

    @classmethod
    def data_source(cls) -> type:
        from oncekit.core.spark.writer import FanOutDataSource

        return FanOutDataSource

    def build(self, checkpoint: str) -> Sink:
        return FanOutSink(self, {route: config.build(checkpoint) for route, config in self.targets.items()})


def sinks_of(config: SinkConfig) -> list[SinkConfig]:
    """The sinks ``config`` writes: a fan-out's targets, or ``config`` itself."""
    return list(config.targets.values()) if isinstance(config, FanOutConfig) else [config]


def fan_out(targets: Mapping[str, SinkConfig], route_column: str = "target", sink_id: str = "") -> FanOutConfig:
    """One query into several targets, each exactly once, through one checkpoint:
    ``fan_out({"balances": postgres_sink(...), "updates": kafka_sink(...)})`` for a stream whose
    ``route_column`` holds "balances" or "updates" in each row.

    :param targets: the sinks, by the route value that sends a row to each.
    :param route_column: the stream's column that names each row's target; it is not written.
    :param sink_id: names the fan-out's journal; by default a digest of its targets' sink ids, so
        that the same targets find the same journal.
    """
    return FanOutConfig(targets=dict(targets), route_column=route_column, sink_id=sink_id)


class FanOutSink(Sink):
    """The engine's one sink for a fan-out query; it delegates to each target's protocol."""

    protocol = "fan-out"

    def __init__(self, config: FanOutConfig, targets: Mapping[str, Sink]) -> None:
        self.config, self.sink_id, self.targets_by_route = config, config.sink_id, dict(targets)

    @property
    def commits_in_task(self) -> bool:
        return any(sink.commits_in_task for sink in self.targets_by_route.values())

    def preflight(self, resumed: bool = False) -> None:
        self._each(lambda sink: sink.preflight(resumed))

    def write_partition(self, task: TaskInfo, batches: Iterator[pa.RecordBatch]) -> list[Committable]:
        """Task: route each Arrow batch of the partition to its targets as it arrives; every
        target writes its part by its own protocol in a thread of its own, side by side, fed
        through a :class:`_Feed` of at most :data:`QUEUED` batches, so the task holds a few
        batches per target rather than its partition. A route value that names no target, an
        input error or a failing target ends every target's input with that error, so each one
        aborts what it had written (a protocol commits or pre-commits only at the end of its
        input) and the task raises the first error."""
        where = f"{FORMAT} sink {self.sink_id} batch {task.batch_id} partition {task.partition_id}"
        if parallel.inline():
            return self._write_one_after_another(task, batches, where)
        feeds = {route: _Feed(where, route) for route in self.targets_by_route}
        with ThreadPoolExecutor(len(self.targets_by_route), thread_name_prefix="oncekit-fanout") as pool:
            writers = {route: pool.submit(sink.write_partition,
                                          TaskInfo(sink.sink_id, task.batch_id, task.partition_id, task.attempt, task.epoch),
                                          iter(feeds[route]))
                       for route, sink in self.targets_by_route.items()}
            for route, writer in writers.items():
                writer.add_done_callback(feeds[route].writer_ended)
            try:
                for batch in batches:
                    if batch.num_rows:
                        self._route(batch, feeds, where)
                    failed = next((w for w in writers.values() if w.done() and w.exception() is not None), None)
                    if failed is not None:
                        raise failed.exception()  # type: ignore[misc]
            except BaseException as exc:
                for feed in feeds.values():
                    feed.end(exc)
                raise
            for feed in feeds.values():
                feed.end()
            return [c for writer in writers.values() for c in writer.result()]

    def _write_one_after_another(self, task: TaskInfo, batches: Iterator[pa.RecordBatch], where: str) -> list[Committable]:
        """Where threads cannot run (:func:`~oncekit.core.parallel.inline`): route the whole
        partition, then let each target write its part, target after target."""
        parts: dict[str, list[pa.RecordBatch]] = {route: [] for route in self.targets_by_route}
        for batch in batches:
            if batch.num_rows:
                self._route(batch, parts, where)
        return [c for route, sink in self.targets_by_route.items()
                for c in sink.write_partition(TaskInfo(sink.sink_id, task.batch_id, task.partition_id, task.attempt,
                                                       task.epoch), iter(parts[route]))]

    def _route(self, batch: pa.RecordBatch, feeds: Mapping[str, Any], where: str) -> None:
        routes = batch.column(batch.schema.get_field_index(self.config.route_column))
        present = pc.unique(routes).to_pylist()  # a few values: cheaper than a set lookup per row
        unknown = [route for route in present if route not in self.targets_by_route]
        if unknown:
            raise ConfigError(f"{where}: rows routed to {unknown} by column {self.config.route_column}, "
                              f"which names no target; targets are {', '.join(self.targets_by_route)}")
        for route in present:
            part = batch if len(present) == 1 else batch.filter(pc.equal(routes, route))
            feed = feeds[route]
            part = part.select(list(self.config.target_columns(route)))
            feed.append(part) if isinstance(feed, list) else feed.put(part)

    def _each(self, call: Callable[[Sink], T]) -> list[T]:
        """Driver: ``call`` on every target side by side (each waits on its own service's round
        trips: a query's start checks, recovers and claims every target); the results in the
        targets' order, or the first target's error in that order once all have returned. The
        commit of a batch is not made so: it goes target after target, with a crash point between."""
        return parallel.side_by_side([functools.partial(call, sink) for sink in self.targets_by_route.values()],
                                     "oncekit-fanout-driver")

    def targets(self) -> list[Sink]:
        return list(self.targets_by_route.values())

    def leftovers(self, batch_ids: Iterable[int] | None = None) -> list[Committable]:
        wanted = None if batch_ids is None else list(batch_ids)
        return [c for found in self._each(lambda sink: sink.leftovers(wanted)) for c in found]

    def refuse_claimed(self, owner: SinkOwner, in_use: Callable[[SinkOwner, SinkOwner], str | None]) -> None:
        self._each(lambda sink: sink.refuse_claimed(owner, in_use))

    def claim(self, owner: SinkOwner) -> None:
        self._each(lambda sink: sink.claim(owner))

    def act_for(self, epoch: int) -> None:
        self.epoch = epoch
        for sink in self.targets_by_route.values():
            sink.act_for(epoch)

    def take_epoch(self, floor: int) -> int:
        """The run's one epoch: the first exactly-once target by sink id takes it (its register
        makes it unique to this run), and every other target holds it (FencedError from one that
        holds a newer run's: this run is superseded already)."""
        ordered = sorted(self.targets_by_route.values(), key=lambda sink: (sink.guarantee is not DeliveryGuarantee.EXACTLY_ONCE,
                                                                          sink.sink_id))
        epoch = ordered[0].take_epoch(floor)
        parallel.side_by_side([functools.partial(sink.hold_epoch, epoch) for sink in ordered[1:]], "oncekit-fanout-driver")
        return epoch

    def hold_epoch(self, epoch: int) -> None:
        self._each(lambda sink: sink.hold_epoch(epoch))

    def forget(self, before_batch: int) -> None:
        for sink in self.targets_by_route.values():
            sink.forget(before_batch)

    def close(self) -> None:
        for sink in self.targets_by_route.values():
            sink.close()


QUEUED = 4
"""Arrow batches waiting per target of a fan-out task: enough to keep a target's writer busy while
the task routes the next batch, few enough that a task holds batches, not its partition."""


class _Feed:
    """One target's input in a fan-out task: batches from the task's thread to the target's
    writer thread, in order, at most :data:`QUEUED` at a time."""

    def __init__(self, where: str, route: str) -> None:
        self.where, self.route = where, route
        self._batches: deque[pa.RecordBatch] = deque()
        self._changed = threading.Condition()
        self._ended = self._writer_ended = False
        self._failed: BaseException | None = None

    def put(self, batch: pa.RecordBatch) -> None:
        """Task thread: hand ``batch`` over, waiting while :data:`QUEUED` are pending; dropped
        if the writer has ended (its result says why)."""
        with self._changed:
            while len(self._batches) >= QUEUED and not self._writer_ended:
                self._changed.wait()  # the writer takes one, or ends (writer_ended notifies)
            if not self._writer_ended:
                self._batches.append(batch)
                self._changed.notify_all()

    def end(self, failed: BaseException | None = None) -> None:
        """Task thread: no more input; with ``failed``, the target's input raises at once."""
        with self._changed:
            self._ended, self._failed = True, failed
            self._changed.notify_all()

    def writer_ended(self, _: Any) -> None:
        """The writer's future is done (returned or raised): nothing more is queued for it."""
        with self._changed:
            self._writer_ended = True
            self._batches.clear()
            self._changed.notify_all()

    def __iter__(self) -> Iterator[pa.RecordBatch]:
        """Writer thread: the batches, in order, until the input ends."""
        while True:
            with self._changed:
                while not self._batches and not self._ended:
                    self._changed.wait()  # the task puts a batch or ends the input (both notify)
                if self._failed is not None:
                    raise TaskInputCutError(f"{self.where}: target {self.route} stopped: "
                                        f"{type(self._failed).__name__}: {self._failed}") from self._failed
                if not self._batches:
                    return
                batch = self._batches.popleft()
                self._changed.notify_all()
            yield batch


def describe(config: FanOutConfig) -> dict[str, Any]:
    """For logs and status pages: the targets with their protocols (no secrets)."""
    return {route: {"sink_id": c.sink_id, "protocol": c.protocol} for route, c in config.targets.items()}

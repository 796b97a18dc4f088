"""4. Latency: input produced at a fixed rate with its produce time in each record, a pipeline
copying it (the kit on three triggers, Spark's own connectors, Kafka Streams and Flink), and a
read_committed consumer that measures, per record, the time from its produce to its visibility
in the output topic.

Each pair gets its own input and output topics (the input is live, so pairs cannot share it)
made by the same producer at the same rate.
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from benchmarks import data, jvm, peers
from benchmarks.cases import failure, slug
from benchmarks.environment import Bench
from benchmarks.table import Ratio, Row, Table
from oncekit.connectors.kafka_admin import create_topic
from oncekit.core.spark.query import Trigger, start_query
from oncekit.sinks.kafka import kafka_sink
from oncekit.sources.kafka import kafka_stream

COLUMNS = ("records", "p50 ms", "p99 ms")
PHASES = ("latestOffset", "queryPlanning", "walCommit", "addBatch", "commitOffsets", "triggerExecution")
"""Spark's own timing of a trigger (``durationMs`` of the query's progress), averaged per pair
over the batches that read input, and its slowest triggers (what the p99 sees): where a pair's
batch time goes, beside its latency."""

# A pair runs its pipeline from (bench, input topic, output topic, checkpoint) while its context
# is open, and gives a Spark query (whose progress says where a batch's time goes) or None.
Start = Callable[[Bench, str, str, str], AbstractContextManager[Any]]


@contextmanager
def stopping(query: Any) -> Iterator[Any]:
    try:
        yield query
    finally:
        query.stop()


def kit(trigger: str | None) -> Start:
    """The kit's source into its transactional sink on a processingTime ``trigger`` (None: Spark's
    default, each batch as soon as the last one ends)."""
    def start(bench: Bench, source: str, output: str, checkpoint: str) -> AbstractContextManager[Any]:
        return stopping(start_query(kafka_stream(bench.spark, bench.servers, source).select("key", "value"),
                                    kafka_sink(bench.servers, output, "transactional"), checkpoint,
                                    trigger=Trigger(processing_time=trigger) if trigger else None))
    return start


def spark(bench: Bench, source: str, output: str, checkpoint: str) -> AbstractContextManager[Any]:
    frame = peers.spark_kafka_stream(bench.spark, bench.servers, source)
    return stopping(peers.spark_kafka_sink(frame, bench.servers, output).option("checkpointLocation", checkpoint)
                    .trigger(processingTime="1 second").start())


def on_jvm(peer: jvm.JvmPeer, guarantee: str, interval_ms: int) -> Start:
    def start(bench: Bench, source: str, output: str, checkpoint: str) -> AbstractContextManager[Any]:
        running: AbstractContextManager[None] = peer.running(bench.servers, source, output, guarantee, interval_ms,
                                                             bench.options.partitions)
        return running
    return start


WARM_UP_S = 2.0


def warm_up(bench: Bench, source: str, output: str, query: Any, timeout_s: float = 120.0) -> int:
    """Start-up is not latency: run input at the measured rate for :data:`WARM_UP_S` and wait
    until all of it is visible in ``output``, so that the measured records meet a pipeline whose
    first batches (Python workers and the kit's clients; JVM consumers and producers) are behind
    it. Returns how many progress reports a Spark ``query`` had by then (0 for another peer)."""
    options = bench.options
    data.produce_at_rate(bench.kafka, source, options.rate, WARM_UP_S, options.record_bytes, options.partitions)
    expected, seen, deadline = int(options.rate * WARM_UP_S), 0, time.monotonic() + timeout_s
    with data.committed_reader(bench.kafka, output) as (consumer, _):
        while seen < expected:
            if query is not None and not query.isActive:
                query.awaitTermination()  # raises the query's error
            if time.monotonic() > deadline:
                raise TimeoutError(f"{output}: {seen:,} of {expected:,} warm-up records visible after {timeout_s:.0f} s")
            seen += len(data.records(consumer.consume(10_000, timeout=0.2)))
    return len(query.recentProgress) if query is not None else 0


def percentile(ordered: list[float], fraction: float) -> float:
    return ordered[round(fraction * (len(ordered) - 1))]


def phases(progress: list[Any]) -> str:
    """Mean ``durationMs`` per phase over the batches of ``progress`` that read input."""
    batches = [p["durationMs"] for p in progress if int(p["numInputRows"])]
    if not batches:
        return "no batch read input"
    means = {phase: sum(int(b.get(phase, 0)) for b in batches) / len(batches) for phase in PHASES}
    slowest = sorted((int(b.get("triggerExecution", 0)) for b in batches), reverse=True)[:3]
    return (f"{len(batches)} batches, mean ms: " + ", ".join(f"{phase} {ms:,.0f}" for phase, ms in means.items())
            + "; slowest triggerExecution ms: " + ", ".join(f"{ms:,}" for ms in slowest))


def measure(bench: Bench, name: str, start: Start, breakdown: list[str]) -> Row:
    options = bench.options
    source, output = f"bench_latency_{slug(name)}_in", f"bench_latency_{slug(name)}_out"
    expected = int(options.rate * options.latency_s)
    print(f"  {name} ({options.rate:,} records/s for {options.latency_s:.0f} s)", file=sys.stderr, flush=True)
    reader = data.LatencyReader(bench.kafka, output, expected, deadline_s=options.latency_s + 120)
    try:
        for topic in (source, output):
            create_topic(bench.kafka, topic, partitions=options.partitions)
        with tempfile.TemporaryDirectory() as checkpoint, start(bench, source, output, checkpoint) as query:
            warmed = warm_up(bench, source, output, query)
            reader.start()
            reader.ready.wait(60)
            data.produce_at_rate(bench.kafka, source, options.rate, options.latency_s, options.record_bytes,
                                 options.partitions)
            reader.join(options.latency_s + 120)
            if query is not None:
                breakdown.append(f"{name}: {phases(list(query.recentProgress)[warmed:])}.")
        check = reader.check()
    except Exception as exc:  # the other pair still runs
        return Row.failed(name, failure(exc))
    if not check.ok:
        return Row.failed(name, str(check))
    ordered = sorted(reader.latencies_ms)
    return Row(name, {"records": expected, "p50 ms": percentile(ordered, 0.5), "p99 ms": percentile(ordered, 0.99)},
               str(check))


def latency_group(bench: Bench) -> Table:
    options = bench.options
    kit_1s, kit_100ms, kit_asap = ("kit transactional, trigger 1 s", "kit transactional, trigger 100 ms",
                                   "kit transactional, default trigger")
    spark_1s = "Spark JVM source -> Spark Kafka sink (at-least-once), trigger 1 s"
    streams, flink = "Kafka Streams exactly_once_v2, commit 100 ms", "Flink exactly-once, checkpoints 100 ms"
    pairs: list[tuple[str, Start]] = [
        (kit_1s, kit("1 second")), (kit_100ms, kit("100 milliseconds")), (kit_asap, kit(None)), (spark_1s, spark),
        (streams, on_jvm(jvm.KAFKA_STREAMS, "exactly_once_v2", 100)),
        (flink, on_jvm(jvm.FLINK, "exactly-once", 100))]
    print("4. Latency", file=sys.stderr, flush=True)
    table = Table(
        f"4. Latency, produce to visible: {options.rate:,} records/s for {options.latency_s:.0f} s, "
        f"{options.record_bytes} bytes, {options.partitions} partitions",
        COLUMNS, COLUMNS[1:], "latency; below 1 the kit is faster",
        ratios=[Ratio(kit_1s, spark_1s), Ratio(kit_100ms, streams), Ratio(kit_asap, streams), Ratio(kit_100ms, flink)],
        notes=[f"A read_committed consumer reads the output. {bench.connector.describe()}. {jvm.describe()}. "
               "Kafka Streams runs at its exactly-once defaults (a commit every 100 ms)."])
    breakdown: list[str] = []
    table.rows += [measure(bench, name, start, breakdown) for name, start in pairs]
    table.notes += ["Where a batch's time goes (Spark's progress durationMs):", *(f"- {line}" for line in breakdown)]
    return table

"""4. Latency: input produced at a fixed rate with its produce time in each record, a query on a
1 s processingTime trigger, and a read_committed consumer that measures, per record, the time
from its produce to its visibility in the output topic.

Each pair gets its own input and output topics (the input is live, so pairs cannot share it)
made by the same producer at the same rate.
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from benchmarks import data, peers
from benchmarks.cases import failure, slug
from benchmarks.environment import Bench
from benchmarks.table import Ratio, Row, Table
from oncekit.connectors.kafka import create_topic
from oncekit.core.spark.query import start_query
from oncekit.sinks.kafka import kafka_sink
from oncekit.sources.kafka import kafka_stream

TRIGGER = "1 second"
COLUMNS = ("records", "p50 ms", "p99 ms")
PHASES = ("latestOffset", "queryPlanning", "walCommit", "addBatch", "commitOffsets", "triggerExecution")
"""Spark's own timing of a trigger (``durationMs`` of the query's progress), averaged per pair
over the batches that read input, and its slowest triggers (what the p99 sees): where a pair's
batch time goes, beside its latency."""

# A pair starts its query from (bench, input topic, output topic, checkpoint); the query has stop().
Start = Callable[[Bench, str, str, str], Any]


def start_kit(bench: Bench, source: str, output: str, checkpoint: str) -> Any:
    return start_query(kafka_stream(bench.spark, bench.servers, source).select("key", "value"),
                       kafka_sink(bench.servers, output, "transactional"), checkpoint,
                       trigger={"processingTime": TRIGGER})


def start_spark(bench: Bench, source: str, output: str, checkpoint: str) -> Any:
    frame = peers.spark_kafka_stream(bench.spark, bench.servers, source)
    return (peers.spark_kafka_sink(frame, bench.servers, output).option("checkpointLocation", checkpoint)
            .trigger(processingTime=TRIGGER).start())


WARM_UP_S = 2.0


def warm_up(bench: Bench, source: str, query: Any, timeout_s: float = 120.0) -> int:
    """Start-up is not latency: run input at the measured rate for :data:`WARM_UP_S` and wait
    until the query has read all of it, so that the measured records meet a query whose first
    batches (Python workers and the kit's clients; Spark's JVM consumers and producer) are
    behind it. Returns how many progress reports the warm-up took."""
    options = bench.options
    data.produce_at_rate(bench.kafka, source, options.rate, WARM_UP_S, options.record_bytes, options.partitions)
    expected, deadline = int(options.rate * WARM_UP_S), time.monotonic() + timeout_s
    while sum(int(p["numInputRows"]) for p in query.recentProgress) < expected:
        if not query.isActive:
            query.awaitTermination()  # raises the query's error
        if time.monotonic() > deadline:
            raise TimeoutError(f"the query did not read its {expected:,} warm-up records in {timeout_s:.0f} s")
        time.sleep(0.2)
    return len(query.recentProgress)


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
        with tempfile.TemporaryDirectory() as checkpoint:
            query = start(bench, source, output, checkpoint)
            try:
                warmed = warm_up(bench, source, query)
                reader.start()
                reader.ready.wait(60)
                data.produce_at_rate(bench.kafka, source, options.rate, options.latency_s, options.record_bytes,
                                     options.partitions)
                reader.join(options.latency_s + 120)
                breakdown.append(f"{name}: {phases(list(query.recentProgress)[warmed:])}.")
            finally:
                query.stop()
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
    kit, spark = "kit source -> kit transactional sink", "Spark JVM source -> Spark Kafka sink"
    print("4. Latency", file=sys.stderr, flush=True)
    table = Table(
        f"4. Latency, produce to visible: {options.rate:,} records/s for {options.latency_s:.0f} s, "
        f"{options.record_bytes} bytes, {options.partitions} partitions, processingTime {TRIGGER}",
        COLUMNS, COLUMNS[1:], "latency; below 1 the kit is faster", ratios=[Ratio(kit, spark)],
        notes=[f"A read_committed consumer reads the output. {bench.connector.describe()}."])
    breakdown: list[str] = []
    table.rows += [measure(bench, kit, start_kit, breakdown), measure(bench, spark, start_spark, breakdown)]
    table.notes += ["Where a batch's time goes (Spark's progress durationMs):", *(f"- {line}" for line in breakdown)]
    return table

"""9. Partitions: what a batch costs as the input's partition count grows.

The same records in topics of 2, 32 and 128 partitions (:data:`COUNTS`), each read in batches of
:data:`PER_BATCH` records by the kit's source into Spark's noop sink (the baseline), by Spark's
own source into noop, and by the kit's source into each exactly-once protocol. The kit's source
gives a batch at most as many tasks as the session has cores (``kafka_stream``'s
``max_partitions`` default), each reading a group of topic-partitions, so a sink's per-task cost
(its transaction, marker, connection) stays as the count grows; one more baseline case reads with
a task per topic-partition (:data:`UNGROUPED`), as Spark's own source does. The figure is seconds
per batch, from the query's start to its end over the batches it ran; ratios are to the baseline
at the same count.
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from benchmarks import data, peers
from benchmarks.cases import Case, Group, columns, kit_query, measure
from benchmarks.environment import Bench
from benchmarks.table import Check, Ratio, Row, Table
from oncekit.connectors.kafka_admin import create_topic
from oncekit.sinks.kafka import kafka_sink
from oncekit.sinks.postgres import postgres_sink
from oncekit.sources.kafka import kafka_stream

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

    from oncekit.core.protocol import SinkConfig

COUNTS = (2, 32, 128)
RECORDS = 256_000
PER_BATCH = 64_000
NOOP = "kit source -> noop"
SPARK_NOOP = "Spark's source -> noop"
PROTOCOLS = ("postgres two-phase-commit", "postgres write-ahead-log", "postgres idempotent", "kafka transactional",
             "kafka write-ahead-log")
"""Every exactly-once protocol, as the cases name them."""
UNGROUPED = "kit source, a task per partition -> noop"
ONE_TASK_EACH = 1_000_000
"""A ``max_partitions`` above any partition count: a task per topic-partition."""


def partitions_group(bench: Bench) -> Table:
    print("9. Partitions", file=sys.stderr, flush=True)

    def stream(source: data.Input, connector: str = "oncekit", max_partitions: int | None = None) -> DataFrame:
        return kafka_stream(bench.spark, bench.servers, source.topic, max_offsets_per_trigger=PER_BATCH,
                            connector=connector, max_partitions=max_partitions)

    sinks: dict[str, Callable[[str], SinkConfig]] = {
        "postgres two-phase-commit": lambda output: postgres_sink(bench.dsn, output, "two-phase-commit"),
        "postgres write-ahead-log": lambda output: postgres_sink(bench.dsn, output, "write-ahead-log"),
        "postgres idempotent": lambda output: postgres_sink(bench.dsn, output, "idempotent", key_columns=("id",)),
        "kafka transactional": lambda output: kafka_sink(bench.servers, output, "transactional"),
        "kafka write-ahead-log": lambda output: kafka_sink(bench.servers, output, "write-ahead-log"),
    }

    def into(protocol: str) -> Callable[[data.Input, str], Any]:
        def run(source: data.Input, output: str) -> None:
            frame = stream(source).select("key", "value") if protocol.startswith("kafka") else columns(stream(source))
            kit_query(frame, sinks[protocol](output))
        return run

    cases = [Case(NOOP, lambda source, _: peers.run_available(stream(source).writeStream.format("noop"))),
             Case(SPARK_NOOP, lambda source, _: peers.run_available(stream(source, "spark").writeStream.format("noop"))),
             Case(UNGROUPED, lambda source, _: peers.run_available(
                 stream(source, max_partitions=ONE_TASK_EACH).writeStream.format("noop"))),
             *(Case(protocol, into(protocol), keyed=protocol.endswith("idempotent")) for protocol in PROTOCOLS)]

    def prepare(case: Case, output: str) -> None:
        if case.name.startswith("postgres"):
            data.fresh_table(bench.dsn, output, case.keyed)
        elif case.name.startswith("kafka"):
            create_topic(bench.kafka, output, partitions=bench.options.partitions)

    def check(source: data.Input, output: str, got: Any) -> Check:
        if isinstance(got, int):  # noop: the rows the query read
            return Check(source.records, got, None)
        if output.startswith("bench_kafka"):
            return data.read_topic(bench.kafka, output, source.records)
        return data.read_table(bench.dsn, output, source.records)

    group = Group("9. Partitions", cases, check=check, prepare=prepare)
    batches = -(-RECORDS // PER_BATCH)
    table = Table(f"9. Partitions: {RECORDS:,} records of {bench.options.record_bytes} bytes, {PER_BATCH:,} a batch "
                  f"({batches} batches)", ("seconds", "s per batch"), ("s per batch",),
                  "seconds per batch; above 1 costs more than the baseline at the same partition count",
                  notes=["The kit's source gives a batch at most as many tasks as the session's cores, each reading a group "
                         "of input partitions (but the ungrouped case: a task per input partition). Each case runs once on each topic, right after a "
                         "run of the baseline on the 2-partition topic (dropped) warms the session; Kafka outputs have "
                         f"{bench.options.partitions} partitions. Ratios: each case to the kit's source into noop, "
                         "and the kit's source to Spark's, at the same count."])
    inputs = {count: data.produce(bench.kafka, f"partitions_{count}_{uuid.uuid4().hex[:6]}", RECORDS,
                                  bench.options.record_bytes, count) for count in COUNTS}
    measure(group, cases[0], inputs[COUNTS[0]])  # warm-up, dropped
    for count, source in inputs.items():
        for case in cases:
            row = measure(group, case, source)
            name = f"{count} partitions: {case.name}"
            table.rows.append(Row(name, {"seconds": row.figures["seconds"], "s per batch": row.figures["seconds"] / batches}
                                  if row.ok else {}, row.read_back))
        base = f"{count} partitions: {NOOP}"
        table.ratios += [Ratio(f"{count} partitions: {case.name}", base) for case in cases[2:]]
        table.ratios.append(Ratio(base, f"{count} partitions: {SPARK_NOOP}"))
    return table

"""The throughput groups: each case runs the same input into its own fresh output, is timed from
query start to termination, and is read back before its figure counts.

1. source: the kit's source and Spark's JVM source into Spark's noop sink; a raw consume loop.
2. kafka: the kit's three Kafka sinks and Spark's Kafka sink, all fed by the kit's source; Quix
   Streams, Kafka Streams and Flink copying the same topic.
3. postgres: the kit's four PostgreSQL protocols and a hand-written foreachBatch COPY, into a plain
   table and into one keyed like the idempotent sink's, all fed by the kit's source.
"""

from __future__ import annotations

import re
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from benchmarks import data, jvm, peers, usage
from benchmarks.environment import Bench
from benchmarks.peers import Timed
from benchmarks.table import Check, Ratio, Row, Table
from oncekit.connectors.kafka_admin import create_topic
from oncekit.core.fanout import fan_out
from oncekit.core.spark.query import Trigger, start_query
from oncekit.sinks.kafka import kafka_sink
from oncekit.sinks.kafka.config import KafkaProtocol
from oncekit.sinks.postgres import postgres_sink
from oncekit.sinks.postgres.config import PostgresProtocol
from oncekit.sources.kafka import kafka_stream

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

    from oncekit.core.protocol import SinkConfig

THROUGHPUT = ("seconds", "records/s", "cores used", "per core")
PEAK_MB = "worker MB"
"""``cores used``: CPU seconds of the pipeline's processes (benchmarks/usage.py) over the run's wall
seconds; ``per core``: records per CPU second, what a core of the pipeline copies."""


@dataclass(frozen=True)
class Case:
    """``run`` takes the input and the output's name (a topic or table made for this case), and
    returns what the group's check needs besides the output, or a :class:`Timed`. A case of
    ``own_process`` runs in a process that ends with it, so a warm-up run gives it nothing."""

    name: str
    run: Callable[[data.Input, str], Any]
    keyed: bool = False
    own_process: bool = False


@dataclass(frozen=True)
class Group:
    title: str
    cases: list[Case]
    check: Callable[[data.Input, str, Any], Check]
    prepare: Callable[[Case, str], None] = lambda case, output: None
    ratios: list[Ratio] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    memory: bool = False
    """Also sample the largest Python worker's resident memory during each run (``peak worker MB``)."""

    @property
    def columns(self) -> tuple[str, ...]:
        return (*THROUGHPUT, PEAK_MB) if self.memory else THROUGHPUT


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def failure(exc: BaseException) -> str:
    """The first line of an error (for a failed Spark query, its cause), short enough for a table cell."""
    lines = str(exc).strip().splitlines()
    first = lines[0].split("terminated with exception: ", 1)[-1] if lines else ""
    return f"{type(exc).__name__}: {first[:160]}"


def measure(group: Group, case: Case, source: data.Input, round_: int = 0) -> Row:
    output = f"bench_{slug(case.name)}_{source.tag}" + (f"_{round_}" if round_ else "")
    print(f"  {case.name} ({source.tag}, {source.records:,} records)", file=sys.stderr, flush=True)
    try:
        group.prepare(case, output)
        with usage.Usage(memory=group.memory) as used:
            started = time.perf_counter()
            result = case.run(source, output)
            wall = time.perf_counter() - started
        seconds = result.seconds if isinstance(result, Timed) else wall
        check = group.check(source, output, result)
    except Exception as exc:  # one case failing leaves the others to run
        return Row.failed(case.name, failure(exc))
    if not check.ok:
        return Row.failed(case.name, str(check))
    print(f"    {seconds:.1f} s", file=sys.stderr, flush=True)  # every round's figure, to see the spread
    read_back = str(check)
    if isinstance(result, Timed) and result.from_first_record:
        read_back += (f"; from its first record read: {result.from_first_record:.1f} s, "
                      f"{source.records / result.from_first_record:,.0f} records/s")
    figures = {"seconds": seconds, "records/s": source.records / seconds, "cores used": used.cpu_seconds / wall,
               "per core": source.records / used.cpu_seconds}
    if group.memory:
        figures[PEAK_MB] = used.peak_worker_mb
    return Row(case.name, figures, read_back)


def run_group(bench: Bench, group: Group) -> Table:
    """``rounds`` rounds of every case on the measured input, each case's figure its fastest
    round (a failed round fails the case). Every measured run comes right after a run of the
    same case on the warm-up input (rows dropped): the JVM keeps compiling its hot paths well
    past a 20,000-record warm-up (measured once, a group's first case ran up to 25 % slower than
    in a second round), and Spark ends Python workers idle for a minute, so a case that followed
    the Quix Streams cases (another process, over a minute) started new workers, imports and
    clients inside its timing (the kit's transactional sink: 11.7-14.4 s against 7.0-9.9 s)."""
    print(f"{group.title}", file=sys.stderr, flush=True)
    rounds = bench.options.rounds
    notes = [*group.notes, f"Each figure is the fastest of {rounds} rounds; a round runs every case in turn, each "
             "right after a warm-up run of it." if rounds > 1 else "One round, each case right after a warm-up run of it."]
    notes.append("cores used: CPU seconds of the pipeline's processes (Spark's JVM and Python workers, or the peer's "
                 "own process from its start) over the run's wall seconds; the services are not counted. per core: "
                 "records per CPU second.")
    if group.memory:
        notes.append(f"{PEAK_MB}: the largest resident memory of one Spark Python worker, sampled every 0.25 s.")
    table = Table(f"{group.title}: {bench.options.describe()}", group.columns, ("records/s", "per core"),
                  "records/s; above 1 the kit is faster", ratios=group.ratios, notes=notes)

    def warm_then_measure(case: Case, round_: int) -> Row:
        if bench.warmup is not None and not case.own_process:
            measure(group, case, bench.warmup, round_)
        return measure(group, case, bench.measured, round_)

    runs = [[warm_then_measure(case, round_) for case in group.cases] for round_ in range(1, rounds + 1)]
    table.rows += [fastest(case_runs) for case_runs in zip(*runs)]
    return table


def fastest(runs: tuple[Row, ...]) -> Row:
    """The case's fastest round, or its first failure."""
    failed = [row for row in runs if not row.ok]
    return failed[0] if failed else min(runs, key=lambda row: row.figures["seconds"])


def kit_stream(bench: Bench, source: data.Input, connector: str = "oncekit") -> DataFrame:
    """The input through :func:`kafka_stream` (``connector="spark"``: Spark's own Kafka source)."""
    return kafka_stream(bench.spark, bench.servers, source.topic, max_offsets_per_trigger=bench.options.per_batch,
                        connector=connector)


def kit_query(frame: DataFrame, sink: SinkConfig) -> None:
    kit_queries([(frame, sink)])


def kit_queries(queries: list[tuple[DataFrame, SinkConfig]]) -> None:
    """Each frame into its sink over all available input, the queries side by side in the session."""
    with ExitStack() as checkpoints:
        started = [start_query(frame, sink, checkpoints.enter_context(tempfile.TemporaryDirectory()),
                               trigger=Trigger(available_now=True)) for frame, sink in queries]
        for query in started:
            query.await_termination()


def columns(frame: DataFrame, *keep: str) -> DataFrame:
    """The input's CSV value as the PostgreSQL tables' columns, after the input's columns ``keep``."""
    return (frame.selectExpr(*keep, "split(CAST(value AS STRING), ',') AS f")
            .selectExpr(*keep, "CAST(f[0] AS BIGINT) AS id", "CAST(f[1] AS INT) AS account",
                        "CAST(f[2] AS BIGINT) AS amount", "f[3] AS note"))


def source_group(bench: Bench) -> Table:
    kit, jvm, raw = "kit source -> noop", "Spark JVM source -> noop", "raw confluent-kafka consume loop"
    return run_group(bench, Group(
        "1. Source",
        [Case(kit, lambda source, _: peers.run_available(kit_stream(bench, source).writeStream.format("noop"))),
         Case(jvm, lambda source, _: peers.run_available(
             peers.spark_kafka_stream(bench.spark, bench.servers, source.topic, bench.options.per_batch)
             .writeStream.format("noop"))),
         Case(raw, lambda source, _: data.read_topic(bench.kafka, source.topic, source.records))],
        # noop keeps nothing: its rows count the query's input rows; the loop counts keys too.
        check=lambda source, _, got: got if isinstance(got, Check) else Check(source.records, got, None),
        ratios=[Ratio(kit, jvm), Ratio(kit, raw)],
        notes=[f"JVM side: {bench.connector.describe()}. The raw loop is a ceiling, not a peer."],
    ))


def kafka_group(bench: Bench) -> Table:
    def kit(protocol: KafkaProtocol, connector: str = "oncekit") -> Case:
        name = f"kit {protocol}" + (", Spark's source" if connector == "spark" else "")
        return Case(name, lambda source, output: kit_query(
            kit_stream(bench, source, connector).select("key", "value"), kafka_sink(bench.servers, output, protocol)))

    def quix(guarantee: str) -> Case:
        return Case(f"Quix Streams {guarantee}", lambda source, output: peers.quix_copy(
            bench.options.quix_python, bench.servers, source.topic, output, source.records, guarantee),
            own_process=True)

    def on_jvm(peer: jvm.JvmPeer, guarantee: str, interval_ms: int, name: str) -> Case:
        return Case(name, lambda source, output: peer.copy(bench.servers, source.topic, output, source.records,
                                                           guarantee, interval_ms, bench.options.partitions),
                    own_process=True)

    spark = "Spark Kafka sink (at-least-once)"
    transactional, at_least_once = kit("transactional"), kit("at-least-once")
    streams_eos = on_jvm(jvm.KAFKA_STREAMS, "exactly_once_v2", 100, "Kafka Streams exactly_once_v2")
    streams_eos_1s = on_jvm(jvm.KAFKA_STREAMS, "exactly_once_v2", 1000, "Kafka Streams exactly_once_v2, commit 1 s")
    streams_alos = on_jvm(jvm.KAFKA_STREAMS, "at_least_once", 30_000, "Kafka Streams at_least_once")
    flink_eos = on_jvm(jvm.FLINK, "exactly-once", 1000, "Flink exactly-once, checkpoints 1 s")
    cases = [transactional, kit("write-ahead-log"), at_least_once,
             Case(spark, lambda source, output: peers.run_available(
                 peers.spark_kafka_sink(kit_stream(bench, source), bench.servers, output))),
             quix("exactly-once"), quix("at-least-once"), streams_eos, streams_eos_1s, streams_alos, flink_eos,
             kit("write-ahead-log", "spark"), kit("transactional", "spark")]
    return run_group(bench, Group(
        "2. Kafka sinks", cases,
        prepare=lambda case, output: create_topic(bench.kafka, output, partitions=bench.options.partitions),
        check=lambda source, output, _: data.read_topic(bench.kafka, output, source.records),
        ratios=[*(Ratio(c.name, spark) for c in cases[:3]), Ratio(transactional.name, cases[4].name),
                Ratio(at_least_once.name, cases[5].name),
                *(Ratio(transactional.name, c.name) for c in (streams_eos, streams_eos_1s, flink_eos)),
                Ratio(at_least_once.name, streams_alos.name), Ratio(cases[-2].name, cases[1].name),
                Ratio(cases[-1].name, transactional.name)],
        notes=[f"Spark's sink and the kit's sinks are fed by the kit's source (the last two cases: by Spark's own, "
               "whose rows reach the transactional sink's tasks through a shuffle by their hash); Quix Streams copies the same topic "
               f"with its own consumer, in a process of {bench.options.quix_python}. {bench.connector.describe()}.",
               f"{jvm.describe()}, with as many stream threads or as much parallelism as the input has "
               "partitions. Kafka Streams commits every 100 ms (its exactly-once default), every 1 s, and at "
               "at_least_once every 30 s (its default); Flink commits its Kafka transactions on checkpoints. "
               "Their seconds run from the start of their streams or job to the end of the copy, committed; "
               "Flink's include its MiniCluster's start, and its read-back column gives its figure without it. "
               "Quix Streams and the JVM peers run in a process that ends with them, so they get no warm-up run."],
    ))


def postgres_group(bench: Bench) -> Table:
    def named(name: str, keyed: bool) -> str:
        return name + (" (key id)" if keyed else "")

    def kit(protocol: PostgresProtocol, keyed: bool = False, connector: str = "oncekit") -> Case:
        name = named(f"kit {protocol}", keyed) + (", Spark's source" if connector == "spark" else "")
        return Case(name, lambda source, output: kit_query(
            columns(kit_stream(bench, source, connector)),
            postgres_sink(bench.dsn, output, protocol, key_columns=("id",) if keyed else ())), keyed)

    def copy(keyed: bool) -> Case:
        return Case(named("foreachBatch COPY (at-least-once)", keyed),
                    lambda source, output: peers.run_available(
                        peers.foreach_batch_copy(columns(kit_stream(bench, source)), bench.dsn, output)), keyed)

    plain, keyed = copy(keyed=False), copy(keyed=True)
    idempotent = kit("idempotent", keyed=True)
    cases = [kit("two-phase-commit"), kit("write-ahead-log"), idempotent, kit("at-least-once"), plain, keyed,
             kit("two-phase-commit", connector="spark")]
    return run_group(bench, Group(
        "3. PostgreSQL sinks", cases,
        prepare=lambda case, output: data.fresh_table(bench.dsn, output, case.keyed),
        check=lambda source, output, _: data.read_table(bench.dsn, output, source.records),
        ratios=[*(Ratio(c.name, plain.name) for c in cases[:4]), Ratio(idempotent.name, keyed.name),
                Ratio(cases[-1].name, cases[0].name)],
        notes=["All fed by the kit's source but the last (Spark's own), value parsed into (id, account, amount, note). The foreachBatch peer "
               "COPYs each task's Arrow batches as pyarrow CSV over one psycopg connection per task. The idempotent "
               "sink needs a unique key, so its table has PRIMARY KEY (id); the keyed peer COPYs into a table with "
               "the same key, so the last ratio is what the kit adds and the one before it includes the key's index."],
    ))


TARGETS = ("topic", "two_phase_commit", "write_ahead_log")


def fanout_group(bench: Bench) -> Table:
    """One fan-out query writing every record to three targets (a Kafka topic, transactional; two
    tables, two-phase commit and write-ahead log) against three queries, each reading the input
    and writing it to one of the same targets, side by side. A batch takes all the input, so a
    task holds records / partitions of it."""
    def frame(source: data.Input) -> DataFrame:
        """Key and value for the topic, the parsed value for the tables; a batch takes all input."""
        return columns(kafka_stream(bench.spark, bench.servers, source.topic), "key", "value")

    topic, table = ("key", "value"), ("id", "account", "amount", "note")

    def sinks(output: str) -> dict[str, SinkConfig]:
        return {"topic": kafka_sink(bench.servers, f"{output}_topic", "transactional", columns=topic),
                "two_phase_commit": postgres_sink(bench.dsn, f"{output}_two_phase_commit", "two-phase-commit",
                                                  columns=table),
                "write_ahead_log": postgres_sink(bench.dsn, f"{output}_write_ahead_log", "write-ahead-log",
                                                 columns=table)}

    def one_query(source: data.Input, output: str) -> None:
        routed = frame(source).selectExpr("*", f"explode(array({', '.join(repr(t) for t in TARGETS)})) AS target")
        kit_query(routed, fan_out(sinks(output)))

    def a_query_each(source: data.Input, output: str) -> None:
        kit_queries([(frame(source).select(*(topic if name == "topic" else table)), config)
                     for name, config in sinks(output).items()])

    def prepare(case: Case, output: str) -> None:
        create_topic(bench.kafka, f"{output}_topic", partitions=bench.options.partitions)
        for target in TARGETS[1:]:
            data.fresh_table(bench.dsn, f"{output}_{target}", keyed=False)

    def check(source: data.Input, output: str, _: Any) -> Check:
        checks = [data.read_topic(bench.kafka, f"{output}_topic", source.records),
                  *(data.read_table(bench.dsn, f"{output}_{target}", source.records) for target in TARGETS[1:])]
        return Check(3 * source.records, sum(c.count for c in checks), sum(c.keys or 0 for c in checks))

    fanned, each = Case("kit fan-out, one query, 3 targets", one_query), Case("kit, a query per target", a_query_each)
    return run_group(bench, Group(
        "8. Fan-out", [fanned, each], prepare=prepare, check=check, memory=True, ratios=[Ratio(fanned.name, each.name)],
        notes=["Every input record goes to all three targets: a Kafka topic (transactional), a table by two-phase "
               "commit and one by write-ahead log. records/s counts input records (each written three times). The "
               "three queries run side by side in one session, each reading the whole input. A batch takes all the "
               f"input (not {bench.options.per_batch:,}): a task holds {bench.options.records // bench.options.partitions:,} "
               "records of it."]))

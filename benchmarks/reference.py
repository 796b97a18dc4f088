"""5. The reference pipeline (reference/): one query from a payments topic into balances,
per-minute totals, late events and dead letters in PostgreSQL and balance updates in Kafka.

Two runs, each on topics and tables of its own, each checked as the demo's report checks
(:func:`oncekit.reference.demo.check` against :func:`oncekit.reference.demo.expected`) before
a figure counts:

- sustained throughput: ``options.records`` payment events (1% upstream duplicates, 2% late,
  0.5% malformed) produced first, then the pipeline run once with an availableNow trigger until
  the topic is drained, ``options.per_batch`` records a batch; timed from the query's start to
  its end, and its first batch (Python worker start-up included) on its own; then again in each
  of :data:`VARIANTS` (balance updates by write-ahead log, on the kit's source and on Spark's);
- latency: payments produced at ``options.reference_rate`` events a second for
  ``options.latency_s`` seconds into the pipeline on a 1 s processingTime trigger, after a
  warm-up of ``options.warmup`` events at once and :data:`SETTLE_S` seconds at the rate, neither
  timed; the batches counted are those of the measured part. A read_committed consumer of the
  balance-updates topic times, per payment, produce to visible: an update of account A with ``events`` = n makes the
  first n unique payments of A visible (A's payments sit in one partition in produce order).
  Duplicates and malformed records are not payments of a balance and are not timed.
"""

from __future__ import annotations

import json
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from confluent_kafka import Producer

from benchmarks.cases import failure
from benchmarks.data import committed_reader, records
from benchmarks.latency import percentile
from benchmarks.reference_peer import PeerPipeline
from benchmarks.table import Ratio, Row, Table
from oncekit.connectors import KafkaConfig
from oncekit.core.spark.watchdog import progress_started
from oncekit.reference import config as pipeline_config
from oncekit.reference.demo import Expected, check, expected
from oncekit.reference.generator import Event, Workload, events, produce
from oncekit.reference.outputs import Observed, observe
from oncekit.reference.pipeline import ReferencePipeline

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from benchmarks.environment import Options
    from oncekit.connectors import Services
    from oncekit.reference.config import PipelineConfig

ACCOUNTS = 1_000
DUPLICATES, LATE, MALFORMED = 0.01, 0.02, 0.005
WARMUP_SEED, THROUGHPUT_SEED, LATENCY_SEED = 4, 5, 6
TRIGGER_S = 1
COLUMNS = ("events", "seconds", "events/s", "batch 1 s", "p50 ms", "p99 ms")
PEER = "peer: "
"""The case names' prefix of the plain-PySpark peer's rows (:mod:`benchmarks.reference_peer`)."""
WAIT_S = 120.0  # how long output may take to become visible once input has stopped
SETTLE_S = 15
"""Seconds of input at the latency row's rate, after the warm-up burst and before the measured
part, not timed: the backlog the burst's first batch leaves (and the JIT's first minutes) takes
about ten 1 s batches to drain, and the row measures the pipeline at its rate, not that."""


def workload(count: int, seed: int) -> Workload:
    return Workload(count=count, accounts=ACCOUNTS, duplicates=DUPLICATES, late=LATE, malformed=MALFORMED, seed=seed)


def pipeline_for(services: Services, options: Options, kind: str, **overrides: Any) -> PipelineConfig:
    """The packaged configuration with topics and tables of this run's own (sink ids derive
    from the table names, so runs never share prepared transactions or markers)."""
    name = f"bench_ref_{kind}_{uuid.uuid4().hex[:8]}"
    names = {
        "topics.payments": f"{name}-payments".replace("_", "-"),
        "topics.balance_updates": f"{name}-balance-updates".replace("_", "-"),
        "topics.partitions": options.partitions,
        "tables.balances": f"{name}_balances", "tables.minute_totals": f"{name}_minutes",
        "tables.late_events": f"{name}_late", "tables.dead_letters": f"{name}_dead",
        "pipeline.max_offsets_per_trigger": options.per_batch,
    }
    loaded = pipeline_config.load(None, {**names, **overrides})
    return loaded.with_services(services.kafka.bootstrap_servers, services.postgres.dsn)


def verdict(want: Expected, config: PipelineConfig, seconds: float) -> tuple[str | None, Observed]:
    """The demo's report on the outputs: None when every line is OK, else the first failing line."""
    got = observe(config)
    report = check(want, got, restarts=0, seconds=seconds, crashed=False)
    bad = next(((name, detail) for name, detail, ok in report.lines if not ok), None)
    return (None if bad is None else f"FAILED: {bad[0]}: {bad[1]}"), got


def summary(got: Observed) -> str:
    return (f"report OK: {len(got.balances):,} balances, {len(got.updates):,} updates, {len(got.totals):,} "
            f"minute totals, {len(got.late):,} late, {got.dead_letters:,} dead letters, {got.prepared} prepared")


# -- 1. sustained throughput -------------------------------------------------------------------


@dataclass(frozen=True)
class Throughput:
    events: int
    seconds: float
    batches: list[tuple[int, float]]  # (input rows, seconds) per batch, from the query's progress


def drain(spark: SparkSession, config: PipelineConfig, sent: int, peer: bool = False) -> Throughput:
    with tempfile.TemporaryDirectory() as checkpoint:
        pipeline = PeerPipeline(config, checkpoint) if peer else ReferencePipeline(config, checkpoint)
        started = time.perf_counter()
        pipeline.run(spark, poll_s=0.05)
        seconds = time.perf_counter() - started
        progress = [p for q in pipeline.active for p in q.recentProgress]
    return Throughput(sent, seconds, batch_times(progress))


def batch_times(progress: list[Any]) -> list[tuple[int, float]]:
    """(input rows, seconds) of each batch that read input, from the query's progress."""
    return [(int(p["numInputRows"]), int(p["durationMs"]["triggerExecution"]) / 1000) for p in progress
            if int(p["numInputRows"])]


VARIANTS: dict[str, dict[str, Any]] = {
    "": {},
    ", updates by WAL": {"guarantees.balance_updates": "write-ahead-log"},
    ", Spark's source, updates by WAL": {"pipeline.source": "spark", "guarantees.balance_updates": "write-ahead-log"},
}
"""The sustained case's variants, by the suffix of their case name: the default pipeline; balance
updates by write-ahead log instead of Kafka transactions; and that on Spark's own Kafka source
(which needs the write-ahead log for balance updates). The middle one tells the source's share
from the protocol's."""


def sustained_case(options: Options, variant: str = "", peer: bool = False) -> str:
    return f"{PEER if peer else ''}sustained: availableNow, {options.per_batch:,} per batch{variant}"


def throughput_rows(services: Services, options: Options, spark: SparkSession, count: int, seed: int,
                    variant: str = "", peer: bool = False) -> list[Row]:
    """The sustained case on ``count`` payment events in one of :data:`VARIANTS` (or the plain
    PySpark peer's, :mod:`benchmarks.reference_peer`): its row, and one for the batches after the
    first when there are any."""
    case = sustained_case(options, variant, peer)
    steady = f"  {PEER}the batches after batch 1" if peer else "  the batches after batch 1"
    try:
        config = pipeline_for(services, options, "peer" if peer else "tput", **{"pipeline.trigger_s": 0},
                              **VARIANTS[variant])
        (PeerPipeline(config) if peer else ReferencePipeline(config)).prepare()
        load = workload(count, seed)
        print(f"  {case}: producing {count:,} payment events", file=sys.stderr, flush=True)
        sent = produce(KafkaConfig(config.kafka_bootstrap()), config.topics.payments, load)
        print(f"  {case}: running the pipeline over {sent:,} records", file=sys.stderr, flush=True)
        run = drain(spark, config, sent, peer)
        bad, got = verdict(expected(load, config.pipeline.allowed_lateness_s), config, run.seconds)
    except Exception as exc:  # the latency run still runs
        return [Row.failed(case, failure(exc))]
    if bad is not None:
        return [Row.failed(case, bad)]
    first_rows, first_s = run.batches[0] if run.batches else (0, 0.0)
    rows = [Row(case, {"events": run.events, "seconds": run.seconds, "events/s": run.events / run.seconds,
                       "batch 1 s": first_s}, summary(got))]
    rest = run.batches[1:]
    if rest:
        rest_rows, rest_s = sum(n for n, _ in rest), sum(s for _, s in rest)
        rows.append(Row(steady, {"events": rest_rows, "seconds": rest_s, "events/s": rest_rows / rest_s},
                        f"{len(rest)} batches, time in batches from the query's progress (batch 1: "
                        f"{first_rows:,} records)"))
    return rows


# -- 2. latency at a fixed rate ----------------------------------------------------------------


class UpdateReader(threading.Thread):
    """Reads the balance updates as they become visible: (account, events, monotonic time seen)
    per record, and per account the highest events count seen."""

    def __init__(self, kafka: KafkaConfig, topic: str) -> None:
        super().__init__(name=f"reference-latency-{topic}", daemon=True)
        self.kafka, self.topic = kafka, topic
        self.updates: list[tuple[int, int, float]] = []
        self.visible: dict[int, int] = {}
        self.error: BaseException | None = None
        self.ready = threading.Event()
        self.done = threading.Event()

    def run(self) -> None:
        try:
            with committed_reader(self.kafka, self.topic) as (consumer, _):
                self.ready.set()
                while not self.done.is_set():
                    batch = records(consumer.consume(10_000, timeout=0.05))
                    seen = time.monotonic()
                    for message in batch:
                        update = json.loads(message.value())
                        account, count = int(update["account_id"]), int(update["events"])
                        self.updates.append((account, count, seen))
                        if count > self.visible.get(account, 0):
                            self.visible[account] = count
        except BaseException as exc:  # reported by the row, not lost in the thread
            self.error = exc
        finally:
            self.ready.set()

    def reached(self, counts: dict[int, int]) -> bool:
        if self.error is not None:
            raise self.error
        return all(self.visible.get(a, 0) >= n for a, n in counts.items())


@dataclass
class Produced:
    """Per account: how many unique payments it had before the measured part, and the monotonic
    produce time of each measured one, in produce order."""

    base: dict[int, int] = field(default_factory=dict)
    times: dict[int, list[float]] = field(default_factory=dict)
    seconds: float = 0.0

    def counts(self) -> dict[int, int]:
        return {a: self.base.get(a, 0) + len(self.times.get(a, [])) for a in {*self.base, *self.times}}


def send(producer: Any, topic: str, event: Event) -> None:
    while True:
        try:
            producer.produce(topic, key=event.key, value=event.value)
            return
        except BufferError:  # librdkafka's queue is full: let it drain
            producer.poll(0.05)


def produce_paced(producer: Any, topic: str, measured: list[Event], rate: int, produced: Produced) -> None:
    """``measured`` at ``rate`` records a second, each unique payment's produce time kept."""
    started, i = time.monotonic(), 0
    while i < len(measured):
        due = min(len(measured), int((time.monotonic() - started) * rate) + 1)
        while i < due:
            event = measured[i]
            stamp = time.monotonic()
            send(producer, topic, event)
            if event.unique:
                produced.times.setdefault(int(event.key), []).append(stamp)
            i += 1
        producer.poll(0)
        time.sleep(0.002)
    produced.seconds = time.monotonic() - started


def wait_visible(reader: UpdateReader, pipeline: ReferencePipeline | PeerPipeline, counts: dict[int, int],
                 timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not reader.reached(counts):
        for query in pipeline.active:
            if query.exception() is not None:
                raise RuntimeError(f"query {query.name} failed: {query.exception()}")
        if time.monotonic() > deadline:
            missing = sum(max(0, n - reader.visible.get(a, 0)) for a, n in counts.items())
            raise TimeoutError(f"{missing:,} payments not visible in the balance updates {timeout_s:.0f} s after input")
        time.sleep(0.05)


def latencies_ms(reader: UpdateReader, produced: Produced) -> list[float]:
    """Per measured payment: its produce time to the first update that includes it."""
    shown = dict(produced.base)
    out: list[float] = []
    for account, count, seen in reader.updates:
        base, times = produced.base.get(account, 0), produced.times.get(account, [])
        for k in range(max(shown.get(account, 0), base) + 1, min(count, base + len(times)) + 1):
            out.append((seen - times[k - base - 1]) * 1000)
        shown[account] = max(shown.get(account, 0), count)
    return out


def latency_case(options: Options, peer: bool = False) -> str:
    return (f"{PEER if peer else ''}latency: {options.reference_rate:,} events/s for {options.latency_s:.0f} s, "
            f"processingTime {TRIGGER_S} s")


def latency_row(services: Services, options: Options, spark: SparkSession, peer: bool = False) -> Row:
    rate, seconds = options.reference_rate, options.latency_s
    case = latency_case(options, peer)
    try:
        config = pipeline_for(services, options, "peerlat" if peer else "latency", **{"pipeline.trigger_s": TRIGGER_S})
        (PeerPipeline(config) if peer else ReferencePipeline(config)).prepare()
        kafka = KafkaConfig(config.kafka_bootstrap())
        load = workload(options.warmup + int(rate * (SETTLE_S + seconds)), LATENCY_SEED)
        sent = list(events(load))
        # The warm-up is the workload's first options.warmup events, produced at once, then
        # SETTLE_S seconds of them at the rate, untimed (a duplicate follows its original).
        positions = _positions(sent)
        split = next((i for i, index in enumerate(positions) if index >= options.warmup), len(sent))
        settle = next((i for i, index in enumerate(positions) if index >= options.warmup + rate * SETTLE_S), len(sent))
        warm, settling, measured = sent[:split], sent[split:settle], sent[settle:]
        produced = Produced(base=_unique_counts(sent[:settle]))
        print(f"  {case}: warm-up {len(warm):,} records, {len(settling):,} at the rate untimed, then {len(measured):,}",
              file=sys.stderr, flush=True)
        reader = UpdateReader(kafka, config.topics.balance_updates)
        producer = Producer(kafka.settings(linger_ms=5, enable_idempotence=True))
        with tempfile.TemporaryDirectory() as checkpoint:
            pipeline = PeerPipeline(config, checkpoint) if peer else ReferencePipeline(config, checkpoint)
            reader.start()
            try:
                reader.ready.wait(60)
                pipeline.start(spark)
                for event in warm:
                    send(producer, config.topics.payments, event)
                producer.flush(60)
                wait_visible(reader, pipeline, _unique_counts(warm), WAIT_S)
                produce_paced(producer, config.topics.payments, settling, rate, Produced())
                measuring = time.time()
                produce_paced(producer, config.topics.payments, measured, rate, produced)
                if producer.flush(60):
                    raise RuntimeError("payments still undelivered 60 s after the last was produced")
                wait_visible(reader, pipeline, produced.counts(), WAIT_S)
                pipeline.stop_at_batch_boundary()
            finally:
                pipeline.stop()
                reader.done.set()
                reader.join(30)
            ran = batch_times([p for q in pipeline.active for p in q.recentProgress
                               if progress_started(p) >= measuring])
        if reader.error is not None:
            raise reader.error
        bad, got = verdict(expected(load, config.pipeline.allowed_lateness_s), config, seconds)
    except Exception as exc:
        return Row.failed(case, failure(exc))
    if bad is not None:
        return Row.failed(case, bad)
    ordered = sorted(latencies_ms(reader, produced))
    timed = sum(len(t) for t in produced.times.values())
    if len(ordered) != timed:
        return Row.failed(case, f"FAILED: {len(ordered):,} payments timed, {timed:,} produced")
    return Row(case, {"events": len(measured), "seconds": produced.seconds, "events/s": len(measured) / produced.seconds,
                      "p50 ms": percentile(ordered, 0.5), "p99 ms": percentile(ordered, 0.99)},
               f"{timed:,} payments timed; {len(ran)} batches, {sum(t for _, t in ran) / max(1, len(ran)):.1f} s "
               f"mean, {max((t for _, t in ran), default=0.0):.1f} s max; {summary(got)}")


def _unique_counts(sent: list[Event]) -> dict[int, int]:
    """Per account, its unique payments among ``sent``."""
    counts: dict[int, int] = {}
    for event in sent:
        if event.unique:
            counts[int(event.key)] = counts.get(int(event.key), 0) + 1
    return counts


def _positions(sent: list[Event]) -> list[int]:
    """The workload index of each record (a duplicate has its original's)."""
    out, index = [], -1
    for event in sent:
        if event.unique or event.key == b"malformed":
            index += 1
        out.append(index)
    return out


def reference_pipeline(services: Services, options: Options) -> Table:
    from pyspark.sql import SparkSession

    spark = SparkSession.getActiveSession()  # the harness's (environment.bench): one session per process
    if spark is None:
        raise RuntimeError("the reference group runs inside the harness's Spark session (python -m benchmarks)")
    print("5. Reference pipeline", file=sys.stderr, flush=True)
    table = Table(
        f"5. Reference pipeline (reference/): payments over {ACCOUNTS:,} accounts ({DUPLICATES:.0%} upstream "
        f"duplicates, {LATE:.0%} late, {MALFORMED:.1%} malformed), {options.partitions} partitions",
        COLUMNS, ("events/s", "batch 1 s", "p50 ms", "p99 ms"),
        "above 1 is more events/s, a longer first batch or a longer latency than the same pipeline in plain PySpark",
        ratios=[Ratio(sustained_case(options), sustained_case(options, peer=True)),
                Ratio("  the batches after batch 1", f"  {PEER}the batches after batch 1"),
                Ratio(latency_case(options), latency_case(options, peer=True))],
        notes=["One query: Kafka payments -> dedup (JVM) -> applyInPandasWithState by bucket of accounts -> fan-out "
               "to balances (PostgreSQL 2PC), balance updates (Kafka transactional), minute totals, late events and dead letters "
               "(PostgreSQL idempotent). Every run is checked line by line as `oncekit demo` checks its report.",
               f"Sustained: {options.records:,} payment events, timed from the query's start to its end, after a "
               f"warm-up run of {options.warmup:,} through pipeline outputs of its own; batch 1 s is the first batch "
               "(Python worker start-up included); events counts every record read (duplicates and malformed ones "
               "too).",
               "Latency: produce to visible in the balance-updates topic (read_committed), per unique payment, "
               f"after a warm-up of {options.warmup:,} events and {SETTLE_S} s at the rate, untimed; seconds and "
               "events/s are the producer's; batches are those of the measured part.",
               f"The peer ({PEER.rstrip(': ')} rows): the same pipeline as a PySpark user writes it today, at-least-once: "
               "Spark's Kafka source, the same stages, foreachBatch writing the tables with psycopg (COPY, then one "
               "upsert per table and task) and the balance updates with Spark's Kafka sink; each peer run follows "
               "the kit's, in the same session, and is checked as the kit's is."])
    if options.warmup:  # as every group: the case once on the warm-up's size, its rows dropped
        throughput_rows(services, options, spark, options.warmup, WARMUP_SEED)
    table.rows += throughput_rows(services, options, spark, options.records, THROUGHPUT_SEED)
    sustained = table.rows[0]
    table.rows += throughput_rows(services, options, spark, options.records, THROUGHPUT_SEED, peer=True)
    table.rows.append(latency_row(services, options, spark))
    latency = table.rows[-1]
    table.rows.append(latency_row(services, options, spark, peer=True))
    for variant in list(VARIANTS)[1:]:
        table.rows += throughput_rows(services, options, spark, options.records, THROUGHPUT_SEED, variant)
    if sustained.ok and latency.ok and options.reference_rate > sustained.figures["events/s"]:
        table.notes.append(f"The latency run's {options.reference_rate:,} events/s is above the sustained rate measured "
                           f"here ({sustained.figures['events/s']:,.0f} events/s): its latency is mostly the backlog "
                           "growing over the run.")
    return table

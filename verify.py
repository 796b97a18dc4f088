"""Exactly-once verification: the multiset checker, the kit's example pipeline, and a fault
campaign that crashes a pipeline and checks what it committed.

- :func:`compare` checks committed output against expected output as multisets: a count can
  hide a loss and a duplicate that cancel out; a multiset comparison cannot.
- :func:`run_campaign` runs the example pipeline once per fault, each in a driver process of
  its own: it arms a crash point of the engine at a batch, or kills the driver with SIGKILL
  after a delay, restarts the pipeline from its checkpoint until it finishes (as an operator or
  restart strategy would), and checks the output. ``oncekit verify`` is its command line.

Runs are reproducible from a seed: the fault schedule is drawn from ``random.Random(seed)``.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Hashable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from oncekit.core.crash import CRASH_DIR_ENV, POINTS, arm

if TYPE_CHECKING:
    from oncekit.connectors import KafkaConfig, Services
    from oncekit.sinks.base import SinkConfig

COUNT, PER_BATCH = 1000, 300  # four batches; both partitions have rows in every batch

SINKS = {
    "postgres-two-phase-commit": ("postgres", "two-phase-commit"),
    "postgres-write-ahead-log": ("postgres", "write-ahead-log"),
    "postgres-idempotent": ("postgres", "idempotent"),
    "postgres-at-least-once": ("postgres", "at-least-once"),
    "kafka-transactional": ("kafka", "transactional"),
    "kafka-write-ahead-log": ("kafka", "write-ahead-log"),
    "kafka-at-least-once": ("kafka", "at-least-once"),
}


@dataclass(frozen=True)
class Verdict:
    """What :func:`compare` found. ``exactly_once`` holds when nothing was lost, nothing
    repeated and nothing appeared that was never expected."""

    expected: int
    actual: int
    lost: Counter[Hashable]
    duplicated: Counter[Hashable]
    unexpected: Counter[Hashable]

    @property
    def exactly_once(self) -> bool:
        return not (self.lost or self.duplicated or self.unexpected)

    @property
    def at_least_once(self) -> bool:
        return not self.lost and not self.unexpected

    @property
    def name(self) -> str:
        if self.exactly_once:
            return "exactly-once"
        return "duplicates" if self.at_least_once else "LOSS"

    def summary(self, examples: int = 5) -> str:
        def show(counter: Counter[Hashable]) -> str:
            items = sorted(counter.items(), key=repr)[:examples]
            return f"{sum(counter.values())} {items}" if counter else "0"

        return (f"expected {self.expected}, got {self.actual}; lost {show(self.lost)}; "
                f"duplicated {show(self.duplicated)}; unexpected {show(self.unexpected)}")


def compare(expected: Iterable[Hashable], actual: Iterable[Hashable]) -> Verdict:
    """Compare two multisets of records (any hashable: tuples, strings)."""
    want, got = Counter(expected), Counter(actual)
    surplus = got - want
    return Verdict(
        expected=sum(want.values()),
        actual=sum(got.values()),
        lost=want - got,
        duplicated=Counter({k: v for k, v in surplus.items() if k in want}),
        unexpected=Counter({k: v for k, v in surplus.items() if k not in want}),
    )


# -- the example pipeline: unique integers from Kafka into a sink -----------------------------

def produce_input(kafka: KafkaConfig, topic: str, count: int = COUNT, partitions: int = 2) -> list[int]:
    """Values "0".."count-1" over the partitions in one committed transaction, plus 50 more in an
    aborted one that must never arrive. Returns the expected ids."""
    from confluent_kafka import Producer

    producer = Producer(kafka.settings(transactional_id=f"input-{topic}", linger_ms=5))
    producer.init_transactions(30)
    for ids, commit in ((range(count), True), (range(count, count + 50), False)):
        producer.begin_transaction()
        for i in ids:
            producer.produce(topic, value=str(i).encode(), partition=i % partitions)
        if commit:
            producer.commit_transaction(30)
        else:
            producer.flush(30)
            producer.abort_transaction(30)
    return list(range(count))


def integers(spark: Any, kafka: KafkaConfig, topic: str, per_batch: int = PER_BATCH) -> Any:
    """The stream: one row (id, payload) per input record."""
    from oncekit.sources.kafka import kafka_stream

    return kafka_stream(spark, kafka.bootstrap_servers, topic, max_offsets_per_trigger=per_batch).selectExpr(
        "CAST(CAST(value AS STRING) AS INT) AS id", "CAST(value AS STRING) AS payload")


def example_sink(sink: str, kafka: KafkaConfig, dsn: str, target: str) -> SinkConfig:
    from oncekit.sinks.kafka import kafka_sink
    from oncekit.sinks.postgres import postgres_sink

    kind, protocol = SINKS[sink]
    if kind == "kafka":
        return kafka_sink(kafka.bootstrap_servers, target, protocol)
    return postgres_sink(dsn, target, protocol, key_columns=("id",) if protocol == "idempotent" else ())


def example_frame(sink: str, spark: Any, kafka: KafkaConfig, topic: str) -> Any:
    frame = integers(spark, kafka, topic)
    return frame.selectExpr("CAST(id AS STRING) AS value") if SINKS[sink][0] == "kafka" else frame


def prepare_target(sink: str, kafka: KafkaConfig, dsn: str, target: str) -> None:
    import psycopg

    from oncekit.connectors.kafka import create_topic

    if SINKS[sink][0] == "kafka":
        create_topic(kafka, target, partitions=2)
        return
    keyed = SINKS[sink][1] == "idempotent"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {target} (id int {'PRIMARY KEY' if keyed else 'NOT NULL'}, payload text NOT NULL)")


def read_committed(kafka: KafkaConfig, topic: str, expected: int, timeout_s: float = 30.0) -> list[bytes]:
    """Every value a read_committed consumer sees in ``topic``: waits for ``expected`` values,
    then one more second so that extra values would show."""
    from confluent_kafka import Consumer

    consumer = Consumer(kafka.settings(group_id=f"check-{topic}-{time.monotonic_ns()}", auto_offset_reset="earliest",
                                       isolation_level="read_committed", enable_auto_commit=False))
    consumer.subscribe([topic])
    values: list[bytes] = []
    deadline = time.monotonic() + timeout_s
    settle = None
    try:
        while time.monotonic() < deadline:
            for message in consumer.consume(100, timeout=0.5):
                if message.error() is None:
                    values.append(message.value() or b"")
            if len(values) >= expected:
                settle = settle or time.monotonic() + 1.0
                if time.monotonic() > settle:
                    break
    finally:
        consumer.close()
    return values


def table_ids(dsn: str, table: str) -> list[int]:
    import psycopg

    with psycopg.connect(dsn) as conn:
        return [row[0] for row in conn.execute(f"SELECT id FROM {table}")]


def prepared_transactions(dsn: str) -> list[str]:
    import psycopg

    with psycopg.connect(dsn) as conn:
        return [str(row[0]) for row in conn.execute("SELECT gid FROM pg_prepared_xacts")]


def committed_output(sink: str, kafka: KafkaConfig, dsn: str, target: str, expected: int) -> list[int]:
    if SINKS[sink][0] == "kafka":
        return [int(v) for v in read_committed(kafka, target, expected, timeout_s=60)]
    return table_ids(dsn, target)


# -- the fault campaign ------------------------------------------------------------------------

@dataclass(frozen=True)
class Fault:
    """One injected failure: an armed crash point at a batch, or SIGKILL of the driver after a delay."""

    kind: str
    point: str | None = None
    batch: int | None = None
    delay_s: float | None = None

    def __str__(self) -> str:
        return f"crash {self.point} at batch {self.batch}" if self.kind == "crash" else f"kill -9 after {self.delay_s:.1f} s"


def schedule(seed: int, count: int) -> list[Fault]:
    """A reproducible fault schedule: crash points at random batches and driver kills."""
    rng = random.Random(seed)
    faults = []
    for _ in range(count):
        if rng.random() < 0.25:
            faults.append(Fault("kill", delay_s=round(rng.uniform(2.0, 20.0), 1)))
        else:
            faults.append(Fault("crash", point=rng.choice(POINTS), batch=rng.randrange(0, 4)))
    return faults


@dataclass(frozen=True)
class FaultResult:
    fault: str
    fired: bool
    restarts: int
    recovery_s: float
    verdict: str
    detail: str


def start_driver(sink: str, services: Services, topic: str, target: str, checkpoint: str, crash_dir: str) -> subprocess.Popen[bytes]:
    """Start the example pipeline's driver process, in a session of its own (so that SIGKILL can
    take it and its Spark JVM together), with crash points read from ``crash_dir``."""
    env = {**os.environ, CRASH_DIR_ENV: crash_dir, "ONCEKIT_VERIFY_DSN": services.postgres.dsn}
    return subprocess.Popen(
        [sys.executable, "-m", "oncekit.verify", sink, services.kafka.bootstrap_servers, topic, target, checkpoint],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )


def run_fault(sink: str, services: Services, fault: Fault, name: str, max_restarts: int = 5) -> FaultResult:
    """Run the example pipeline into ``sink`` with one fault, restart until it finishes, check."""
    from oncekit.connectors import KafkaConfig
    from oncekit.connectors.kafka import create_topic

    kafka, dsn = KafkaConfig(services.kafka.bootstrap_servers), services.postgres.dsn
    topic = f"verify-{name}".replace("_", "-")
    target = f"verify_{name}".replace("-", "_") if SINKS[sink][0] == "postgres" else f"{topic}-out"
    create_topic(kafka, topic, partitions=2)
    prepare_target(sink, kafka, dsn, target)
    expected = produce_input(kafka, topic)
    with tempfile.TemporaryDirectory(prefix="oncekit-verify-") as work:
        crash_dir, checkpoint = f"{work}/crash", f"{work}/checkpoint"
        Path(crash_dir).mkdir()
        if fault.kind == "crash":
            arm(crash_dir, fault.point or "", fault.batch)
        first = start_driver(sink, services, topic, target, checkpoint, crash_dir)
        if fault.kind == "kill":
            try:
                first.wait(timeout=fault.delay_s)
            except subprocess.TimeoutExpired:
                os.killpg(first.pid, signal.SIGKILL)
        code = first.wait(timeout=600)
        fired = code != 0
        restarts, recovery_s = 0, 0.0
        while code != 0 and restarts < max_restarts:
            restarts += 1
            started = time.monotonic()
            code = start_driver(sink, services, topic, target, checkpoint, crash_dir).wait(timeout=600)
            recovery_s = time.monotonic() - started
    if code != 0:
        return FaultResult(str(fault), fired, restarts, recovery_s, "FAILED", f"driver still failing (exit {code})")
    verdict = compare(expected, committed_output(sink, kafka, dsn, target, len(expected)))
    left = prepared_transactions(dsn) if SINKS[sink][0] == "postgres" else []
    name_ = verdict.name if not left else "LEFT PREPARED"
    return FaultResult(str(fault), fired, restarts, round(recovery_s, 1), name_, verdict.summary(0))


def run_campaign(sink: str, services: Services, faults: int, seed: int, progress: Any = None) -> list[FaultResult]:
    results = []
    for index, fault in enumerate(schedule(seed, faults)):
        results.append(run_fault(sink, services, fault, f"{sink}-{seed}-{index}-{int(time.time())}"))
        if progress is not None:
            progress(index + 1, faults, results[-1])
    return results


def table(sink: str, seed: int, results: list[FaultResult]) -> str:
    lines = [f"oncekit verify: sink {sink}, seed {seed}, {len(results)} faults",
             f"| {'#':>2} | {'fault':<40} | {'fired':<5} | {'restarts':>8} | {'recovery s':>10} | {'verdict':<13} |",
             f"|{'-' * 4}|{'-' * 42}|{'-' * 7}|{'-' * 10}|{'-' * 12}|{'-' * 15}|"]
    for i, r in enumerate(results):
        lines.append(f"| {i:>2} | {r.fault:<40} | {'yes' if r.fired else 'no':<5} | {r.restarts:>8} | "
                     f"{r.recovery_s:>10.1f} | {r.verdict:<13} |")
    return "\n".join(lines)


def write_json(path: str, sink: str, seed: int, results: list[FaultResult]) -> None:
    Path(path).write_text(json.dumps({"sink": sink, "seed": seed, "results": [asdict(r) for r in results]}, indent=2))


def _driver_main(sink: str, bootstrap: str, topic: str, target: str, checkpoint: str) -> None:
    """The example pipeline's driver process (``python -m oncekit.verify``)."""
    from oncekit.connectors import KafkaConfig
    from oncekit.core.query import start_query
    from oncekit.core.spark import spark_session

    kafka = KafkaConfig(bootstrap)
    spark = spark_session("oncekit-verify")
    sink_config = example_sink(sink, kafka, os.environ.get("ONCEKIT_VERIFY_DSN", ""), target)
    start_query(example_frame(sink, spark, kafka, topic), sink_config, checkpoint,
                trigger={"availableNow": True}).await_termination()
    spark.stop()


if __name__ == "__main__":
    _driver_main(*sys.argv[1:6])

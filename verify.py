"""Exactly-once verification: the multiset checker, the pipelines it runs, and a fault campaign.

- :func:`compare` checks committed output against expected output as multisets: a count can
  hide a loss and a duplicate that cancel out; a multiset comparison cannot.
- A *pipeline under test* is a function ``(spark, ctx: PipelineContext) -> query`` that reads
  ``ctx.input_topic`` and carries each input value (a decimal integer) to its output once: into
  column ``id`` of table ``ctx.output`` or as the value of a record in topic ``ctx.output``.
  The kit's own example pipelines are named in :data:`EXAMPLES`; a user's is ``module:function``.
- :func:`run_campaign` runs one pipeline in a driver process of its own, continuously, and
  injects faults one after another (:func:`schedule`): crash points of the engine (task points
  are retried by Spark itself; driver points fail the query, which the driver's restart
  strategy brings back; ``before_notify`` may take the whole driver process), ``kill -9`` of the
  driver process, Kafka or PostgreSQL stopped and restarted, or cut off the network. Before each
  fault it produces a new chunk of input; after it, it waits until the output has caught up
  (restarting the driver process when it died, as an operator would) and compares everything
  committed so far with everything produced so far. At the end it stops the driver and checks
  that no prepared transaction and no open Kafka transaction is left. ``oncekit verify`` is its
  command line.

Runs are reproducible from a seed: the fault schedule is drawn from ``random.Random(seed)``.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from oncekit.connectors.postgres import connect
from oncekit.core.crash import CRASH_DIR_ENV, POINTS, arm, disarm, fired_at
from oncekit.core.errors import ConfigError, OncekitError

if TYPE_CHECKING:
    from oncekit.connectors import KafkaConfig, Services
    from oncekit.sinks.base import SinkConfig

logger = logging.getLogger(__name__)

COUNT, PER_BATCH = 1000, 300  # the one-shot tests: four batches; both partitions have rows in every batch
CHUNK = 300  # input produced before each fault of a campaign: one batch of PER_BATCH, rows in both partitions


@dataclass(frozen=True)
class Example:
    """One of the kit's example pipelines: integers from Kafka into one sink."""

    kind: str  # "postgres" or "kafka": where the output is read
    protocol: str
    guarantee: str  # what the configuration promises
    points: tuple[str, ...] = POINTS  # crash points its sink reaches
    discards_checkpoint: bool = False  # known-bad: every (re)start deletes the checkpoint, reads from latest


_NO_LATE_COMMIT = tuple(p for p in POINTS if p != "mid_commit")

EXAMPLES = {
    "postgres-two-phase-commit": Example("postgres", "two-phase-commit", "exactly-once"),
    "postgres-write-ahead-log": Example("postgres", "write-ahead-log", "exactly-once"),
    "postgres-idempotent": Example("postgres", "idempotent", "exactly-once", _NO_LATE_COMMIT),
    "postgres-at-least-once": Example("postgres", "at-least-once", "at-least-once", _NO_LATE_COMMIT),
    "postgres-at-most-once": Example("postgres", "at-least-once", "at-most-once", _NO_LATE_COMMIT, True),
    "kafka-transactional": Example("kafka", "transactional", "exactly-once", _NO_LATE_COMMIT),
    "kafka-write-ahead-log": Example("kafka", "write-ahead-log", "exactly-once"),
    "kafka-at-least-once": Example("kafka", "at-least-once", "at-least-once", _NO_LATE_COMMIT),
}
GUARANTEES = ("exactly-once", "at-least-once", "at-most-once")


class VerifyError(OncekitError):
    """The pipeline under test could not be run at all (as opposed to a failed verdict)."""


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
    def at_most_once(self) -> bool:
        return not self.duplicated and not self.unexpected

    def holds(self, guarantee: str) -> bool:
        return {"exactly-once": self.exactly_once, "at-least-once": self.at_least_once,
                "at-most-once": self.at_most_once}[guarantee]

    @property
    def name(self) -> str:
        if self.exactly_once:
            return "exactly-once"
        if self.lost and self.duplicated:
            return "LOSS+DUPLICATES"
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


# -- input and output ------------------------------------------------------------------------

@dataclass(frozen=True)
class Upstream:
    """Faults of the input itself, as fractions of the records: ``duplicates`` are sent twice
    (a producer retry: the output must carry them twice, as the input has them twice),
    ``malformed`` records are not integers (the pipeline must drop or dead-letter them), ``late``
    records carry a Kafka timestamp an hour old (an identity pipeline carries them)."""

    duplicates: float = 0.0
    malformed: float = 0.0
    late: float = 0.0
    seed: int = 0


def produce_input(kafka: KafkaConfig, topic: str, count: int = COUNT, partitions: int = 2, first: int = 0,
                  upstream: Upstream | None = None) -> list[int]:
    """Values ``first``..``first+count-1`` over the partitions in one committed transaction (with
    ``upstream``'s duplicates, malformed and late records mixed in), plus 50 negative ones in an
    aborted transaction that must never arrive. Returns the expected ids, as a multiset."""
    from confluent_kafka import Producer

    upstream = upstream or Upstream()
    rng = random.Random(f"{upstream.seed}-{first}")
    late_ms = int((time.time() - 3600) * 1000)
    records: list[tuple[bytes, int, int | None]] = []
    expected: list[int] = []
    for i in range(first, first + count):
        late = late_ms if rng.random() < upstream.late else None
        copies = 2 if rng.random() < upstream.duplicates else 1
        records += [(str(i).encode(), i % partitions, late)] * copies
        expected += [i] * copies
        if rng.random() < upstream.malformed:
            records.append((f"malformed-{i}".encode(), i % partitions, None))
    producer = Producer(kafka.settings(transactional_id=f"input-{topic}", linger_ms=5))
    producer.init_transactions(30)
    aborted = [(str(i).encode(), i % partitions, None) for i in range(-first - 50, -first)]
    for batch, commit in ((records, True), (aborted, False)):
        producer.begin_transaction()
        for value, partition, timestamp in batch:
            producer.produce(topic, value=value, partition=partition, timestamp=timestamp or 0)
        if commit:
            producer.commit_transaction(30)
        else:
            producer.flush(30)
            producer.abort_transaction(30)
    return expected


def read_committed(kafka: KafkaConfig, topic: str, expected: int, timeout_s: float = 30.0) -> list[bytes]:
    """Every value a read_committed consumer sees in ``topic``: waits for ``expected`` values,
    then one more second so that extra values would show."""
    values: list[bytes] = []
    deadline = time.monotonic() + timeout_s
    settle = None
    with KafkaOutput(kafka, topic) as output:
        while time.monotonic() < deadline:
            values = output.read()
            if len(values) >= expected:
                settle = settle or time.monotonic() + 1.0
                if time.monotonic() > settle:
                    break
    return values


class KafkaOutput:
    """A read_committed consumer of a whole topic, kept open between reads: :meth:`read` returns
    every committed value seen so far, one per (partition, offset), so that a consumer that
    reconnects and reads a stretch again never counts a record twice (a duplicate the sink wrote
    has an offset of its own). :meth:`open_transactions` names the partitions whose last stable
    offset lags the high watermark, i.e. that hold a transaction still open."""

    def __init__(self, kafka: KafkaConfig, topic: str) -> None:
        self.kafka, self.topic = kafka, topic
        self.records: dict[tuple[int, int], bytes] = {}
        self.consumer = self._consumer()

    def _consumer(self) -> Any:
        from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

        consumer = Consumer(self.kafka.settings(group_id=f"check-{self.topic}", isolation_level="read_committed",
                                                enable_auto_commit=False))
        # assign, not subscribe: no group membership to lose (and restart from "earliest") in a broker outage
        partitions = consumer.list_topics(self.topic, timeout=30).topics[self.topic].partitions
        consumer.assign([TopicPartition(self.topic, p, OFFSET_BEGINNING) for p in sorted(partitions)])
        return consumer

    def reconnect(self) -> None:
        """Read the topic again from the start with a new consumer: after a network cut the old
        one can wait out socket timeouts (a minute) before it reads again. Values already seen
        keep their (partition, offset), so nothing is counted twice."""
        self.consumer.close()
        self.consumer = self._consumer()

    def __enter__(self) -> KafkaOutput:
        return self

    def __exit__(self, *exc: object) -> None:
        self.consumer.close()

    def read(self, timeout_s: float = 0.5) -> list[bytes]:
        for message in self.consumer.consume(1000, timeout=timeout_s):
            if message.error() is None:
                self.records[(message.partition() or 0, message.offset() or 0)] = message.value() or b""
        return list(self.records.values())

    def open_transactions(self) -> list[int]:
        from confluent_kafka import Consumer, TopicPartition

        metadata = self.consumer.list_topics(self.topic, timeout=10).topics[self.topic]
        uncommitted = Consumer(self.kafka.settings(group_id="oncekit-watermarks", isolation_level="read_uncommitted"))
        try:
            open_ = []
            for partition in sorted(metadata.partitions):
                tp = TopicPartition(self.topic, partition)
                stable = self.consumer.get_watermark_offsets(tp, timeout=10, cached=False)[1]
                high = uncommitted.get_watermark_offsets(tp, timeout=10, cached=False)[1]
                if stable < high:
                    open_.append(partition)
            return open_
        finally:
            uncommitted.close()


def table_ids(dsn: str, table: str) -> list[int]:
    from psycopg import sql

    with connect(dsn) as conn:
        return [row[0] for row in conn.execute(sql.SQL("SELECT id FROM {}").format(sql.Identifier(table)))]


def prepared_transactions(dsn: str) -> list[str]:
    with connect(dsn) as conn:
        return [str(row[0]) for row in conn.execute("SELECT gid FROM pg_prepared_xacts")]


def committed_output(sink: str, kafka: KafkaConfig, dsn: str, target: str, expected: int) -> list[int]:
    if EXAMPLES[sink].kind == "kafka":
        return [int(v) for v in read_committed(kafka, target, expected, timeout_s=60)]
    return table_ids(dsn, target)


# -- pipelines under test --------------------------------------------------------------------

@dataclass(frozen=True)
class PipelineContext:
    """What a pipeline under test is given: where its input is, where its output goes, and the
    checkpoint it must use (the harness watches it and restarts from it)."""

    bootstrap_servers: str
    input_topic: str
    output: str
    checkpoint: str
    dsn: str = field(default="", repr=False)
    trigger: dict[str, Any] = field(default_factory=lambda: {"processingTime": "500 milliseconds"})
    max_offsets_per_trigger: int = PER_BATCH


def integers(spark: Any, kafka: KafkaConfig, topic: str, per_batch: int = PER_BATCH, starting: str = "earliest") -> Any:
    """The stream: one row (id, payload) per well-formed input record; malformed ones are dropped."""
    from oncekit.sources.kafka import kafka_stream

    return kafka_stream(spark, kafka.bootstrap_servers, topic, max_offsets_per_trigger=per_batch,
                        starting_offsets=starting).selectExpr(
        "TRY_CAST(CAST(value AS STRING) AS INT) AS id", "CAST(value AS STRING) AS payload").where("id IS NOT NULL")


def example_sink(sink: str, kafka: KafkaConfig, dsn: str, target: str) -> SinkConfig:
    from oncekit.sinks.kafka import kafka_sink
    from oncekit.sinks.postgres import postgres_sink

    example = EXAMPLES[sink]
    if example.kind == "kafka":
        return kafka_sink(kafka.bootstrap_servers, target, example.protocol)
    return postgres_sink(dsn, target, example.protocol, key_columns=("id",) if example.protocol == "idempotent" else ())


def example_frame(sink: str, spark: Any, kafka: KafkaConfig, topic: str, per_batch: int = PER_BATCH) -> Any:
    starting = "latest" if EXAMPLES[sink].discards_checkpoint else "earliest"
    frame = integers(spark, kafka, topic, per_batch, starting)
    return frame.selectExpr("CAST(id AS STRING) AS value") if EXAMPLES[sink].kind == "kafka" else frame


def start_example(sink: str, spark: Any, ctx: PipelineContext) -> Any:
    """Start the kit's example pipeline ``sink`` (a key of :data:`EXAMPLES`) as ``ctx`` says."""
    from oncekit.connectors import KafkaConfig
    from oncekit.core.query import start_query

    kafka = KafkaConfig(ctx.bootstrap_servers)
    if EXAMPLES[sink].discards_checkpoint:  # the operator's mistake this example stands for
        shutil.rmtree(ctx.checkpoint, ignore_errors=True)
    return start_query(example_frame(sink, spark, kafka, ctx.input_topic, ctx.max_offsets_per_trigger),
                       example_sink(sink, kafka, ctx.dsn, ctx.output), ctx.checkpoint, trigger=ctx.trigger)


def prepare_target(sink: str, kafka: KafkaConfig, dsn: str, target: str) -> None:
    """Create the output of pipeline ``sink`` (an example's name or ``module:function``): a
    two-partition topic, or a table ``(id, payload)`` keyed by id for idempotent sinks."""
    from psycopg import sql

    from oncekit.connectors.kafka import create_topic

    example = EXAMPLES.get(sink)
    kind = example.kind if example else sink_kind(sink)
    if kind == "kafka":
        create_topic(kafka, target, partitions=2)
        return
    keyed = example is not None and example.protocol == "idempotent"
    with connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE TABLE IF NOT EXISTS {} (id bigint {}, payload text)").format(
            sql.Identifier(target), sql.SQL("PRIMARY KEY" if keyed else "NOT NULL")))


def sink_kind(pipeline: str) -> str:
    """Where pipeline ``pipeline``'s output is read: an example's kind, or the ``kind`` attribute
    a user's function may carry (default postgres)."""
    if pipeline in EXAMPLES:
        return EXAMPLES[pipeline].kind
    kind = str(getattr(resolve(pipeline), "kind", "postgres"))
    if kind not in ("postgres", "kafka"):
        raise ConfigError(f"pipeline {pipeline}: kind must be 'postgres' or 'kafka', not {kind!r}")
    return kind


def resolve(pipeline: str) -> Callable[[Any, PipelineContext], Any]:
    """The function behind ``pipeline``: an example's name or ``module:function``."""
    if pipeline in EXAMPLES:
        return lambda spark, ctx: start_example(pipeline, spark, ctx)
    module, _, name = pipeline.partition(":")
    if not module or not name:
        raise ConfigError(f"pipeline {pipeline!r}: give one of {', '.join(EXAMPLES)} or module:function")
    try:
        function = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"pipeline {pipeline!r}: cannot load it: {exc}") from exc
    if not callable(function):
        raise ConfigError(f"pipeline {pipeline!r} is not callable")
    return function  # type: ignore[no-any-return]


# -- the driver process ----------------------------------------------------------------------

def start_driver(pipeline: str, ctx: PipelineContext, crash_dir: str, drain: bool = False,
                 log: Path | None = None, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start the driver process of ``pipeline`` (``python -m oncekit.verify``) in a session of its
    own, so that SIGKILL takes it and its Spark JVM together, with crash points read from
    ``crash_dir``. ``drain``: run until the input is drained (availableNow), once, without
    restarts; else run until SIGTERM, restarting the query as a restart strategy would."""
    spec = {"pipeline": pipeline, "context": {**asdict(ctx), "dsn": ""}, "drain": drain}
    environment = {**os.environ, **(env or {}), CRASH_DIR_ENV: crash_dir, "ONCEKIT_VERIFY_DSN": ctx.dsn}
    out = open(log, "ab") if log else subprocess.DEVNULL
    try:
        return subprocess.Popen([sys.executable, "-m", "oncekit.verify", json.dumps(spec)], env=environment,
                                stdout=out, stderr=out, start_new_session=True)
    finally:
        if log:
            out.close()  # type: ignore[union-attr]


def _driver_main(spec_text: str) -> int:
    """The driver process: ``python -m oncekit.verify '<spec json>'``."""
    from oncekit.core.restart import ExponentialBackoff, supervise
    from oncekit.core.spark import spark_session

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spec = json.loads(spec_text)
    context = {**spec["context"], "dsn": os.environ.get("ONCEKIT_VERIFY_DSN", "")}
    if spec["drain"]:
        context["trigger"] = {"availableNow": True}
    ctx = PipelineContext(**context)
    build = resolve(spec["pipeline"])
    # Spark retries a failed task (local[cores,maxFailures] in local mode; a cluster's own conf else).
    master = os.environ.get("SPARK_MASTER") or "local[2,4]"
    spark = spark_session("oncekit-verify", master=master,
                          conf={f"spark.executorEnv.{CRASH_DIR_ENV}": os.environ.get(CRASH_DIR_ENV, "")})
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    restarts_file = Path(ctx.checkpoint + ".restarts")

    def run() -> None:
        query = build(spark, ctx)
        Path(ctx.checkpoint + ".started").touch()  # the harness waits for it before producing
        wait = getattr(query, "await_termination", None) or query.awaitTermination
        while not wait(0.5):
            if stopping.is_set():
                query.stop()
                return

    def note_restart(count: int, error: BaseException) -> None:
        with restarts_file.open("a") as f:
            f.write(f"{time.time()} {type(error).__name__}\n")

    if spec["drain"]:
        run()
    else:
        supervise(run, ExponentialBackoff(initial_s=0.5, max_s=4.0, attempts=40), note_restart)
    spark.stop()
    return 0


# -- faults ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Fault:
    """One injected failure. ``kind``: ``crash`` (``point`` armed for the next batch that reaches
    it), ``kill`` (SIGKILL of the driver ``delay_s`` after the chunk is produced), or
    ``<service>-restart`` / ``<service>-cut`` (stopped, or cut off the network, ``delay_s`` after
    the chunk is produced, for ``outage_s``)."""

    kind: str
    point: str | None = None
    delay_s: float = 0.0
    outage_s: float = 0.0

    def __str__(self) -> str:
        if self.kind == "crash":
            task = " (task retried by Spark)" if (self.point or "").startswith("task_") else ""
            return f"crash {self.point}{task}"
        if self.kind == "kill":
            return f"kill -9 driver after {self.delay_s:.1f} s"
        service, _, action = self.kind.partition("-")
        what = "stopped" if action == "restart" else "cut off network"
        return f"{service} {what} {self.outage_s:.0f} s"


SERVICE_FAULTS = ("kafka-restart", "postgres-restart", "kafka-cut", "postgres-cut")


def schedule(seed: int, count: int, points: Iterable[str] = POINTS, network_cuts: bool = True) -> list[Fault]:
    """A reproducible fault schedule: about half crash points, a tenth driver kills, a third
    service faults (network cuts only where the backend can make them)."""
    rng = random.Random(seed)
    points = tuple(points)
    services = [k for k in SERVICE_FAULTS if network_cuts or not k.endswith("-cut")]
    faults = []
    for _ in range(count):
        draw = rng.random()
        if draw < 0.55:
            faults.append(Fault("crash", point=rng.choice(points)))
        elif draw < 0.65:
            faults.append(Fault("kill", delay_s=round(rng.uniform(0.2, 3.0), 1)))
        else:
            faults.append(Fault(rng.choice(services), delay_s=round(rng.uniform(0.0, 1.5), 1),
                                outage_s=round(rng.uniform(1.0, 6.0))))
    return faults


@dataclass(frozen=True)
class FaultResult:
    """One fault's row in the campaign table. ``batch``: the batch it hit (the batch in flight
    for kills and service faults); ``recovery_s``: from the end of the fault (the crash, the
    kill, the service back) until all input produced so far was committed in the output."""

    fault: str
    fired: bool
    batch: int | None
    query_restarts: int
    driver_restarts: int
    recovery_s: float
    verdict: str
    detail: str


@dataclass
class _Driver:
    """The campaign's driver process, restarted when it dies."""

    pipeline: str
    ctx: PipelineContext
    crash_dir: str
    log: Path
    env: dict[str, str]
    process: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    launched: float = 0.0  # wall-clock time of the last (re)start

    def ensure_running(self, timeout_s: float = 180.0) -> None:
        """Start the driver if it is not running; the first time, wait until its query started."""
        if self.process is not None and self.process.poll() is None:
            return
        first = self.process is None
        if not first:
            self.restarts += 1
            logger.info("verify: driver exited with %s; restarting it", self.process.returncode)  # type: ignore[union-attr]
        self.launched = time.time()
        self.process = start_driver(self.pipeline, self.ctx, self.crash_dir, log=self.log, env=self.env)
        started = Path(self.ctx.checkpoint + ".started")
        deadline = time.monotonic() + timeout_s
        while first and not started.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise VerifyError(f"pipeline {self.pipeline}: the driver did not start its query "
                                  f"(exit {self.process.poll()}); see {self.log}")
            time.sleep(0.2)
        while first and _latest(Path(self.ctx.checkpoint) / "offsets") is None and time.monotonic() < deadline:
            # The first trigger plans an empty batch 0 at the starting offsets; a crash point armed
            # for "the next batch" must not be spent on it.
            time.sleep(0.2)

    def running_query(self) -> bool:
        """The current driver process has started its query."""
        started = Path(self.ctx.checkpoint + ".started")
        return self.process is not None and self.process.poll() is None \
            and started.exists() and started.stat().st_mtime >= self.launched

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def stop(self, timeout_s: float = 120.0) -> int | None:
        """SIGTERM: the driver stops its query gracefully (completing its last checkpoint)."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.process.returncode


def _latest(directory: Path) -> int | None:
    ids = [int(p.name) for p in directory.glob("[0-9]*") if p.name.isdigit()]
    return max(ids) if ids else None


class Campaign:
    """One pipeline, one driver, faults one after another; see the module docstring.

    Called by :func:`run_campaign` (and ``oncekit verify``); ``work`` holds the checkpoint, the
    crash points and the driver's log."""

    def __init__(self, pipeline: str, services: Services, name: str, work: Path,
                 chunk: int = CHUNK, per_batch: int = PER_BATCH, env: dict[str, str] | None = None,
                 catch_up_s: float = 240.0, quiet_s: float = 30.0, upstream: Upstream | None = None) -> None:
        from oncekit.connectors import KafkaConfig
        from oncekit.connectors.kafka import create_topic

        self.pipeline, self.services, self.work = pipeline, services, work
        self.kind = sink_kind(pipeline)
        self.kafka = KafkaConfig(services.kafka.bootstrap_servers)
        self.chunk, self.catch_up_s, self.quiet_s = chunk, catch_up_s, quiet_s
        topic = f"verify-{name}".replace("_", "-")
        output = f"verify_{name}".replace("-", "_") if self.kind == "postgres" else f"{topic}-out"
        self.ctx = PipelineContext(services.kafka.bootstrap_servers, topic, output, str(work / "checkpoint"),
                                   services.postgres.dsn, max_offsets_per_trigger=per_batch)
        self.crash_dir = str(work / "crash")
        Path(self.crash_dir).mkdir(parents=True, exist_ok=True)
        create_topic(self.kafka, topic, partitions=2)
        prepare_target(pipeline, self.kafka, services.postgres.dsn, output)
        self.kafka_output = KafkaOutput(self.kafka, output) if self.kind == "kafka" else None
        self.driver = _Driver(pipeline, self.ctx, self.crash_dir, work / "driver.log", env or {})
        self.expected: list[int] = []
        self.upstream = upstream
        self.produced = 0

    def output(self) -> list[int]:
        if self.kafka_output is not None:
            return [int(v) for v in self.kafka_output.read(0.2)]
        return table_ids(self.services.postgres.dsn, self.ctx.output)

    def query_restarts(self) -> int:
        path = Path(self.ctx.checkpoint + ".restarts")
        return len(path.read_text().splitlines()) if path.exists() else 0

    def batch_in_flight(self) -> int | None:
        return _latest(Path(self.ctx.checkpoint) / "offsets")

    def run(self, fault: Fault) -> FaultResult:
        """Produce the next chunk, inject ``fault``, wait for the output to catch up, check."""
        restarts_before, driver_before = self.query_restarts(), self.driver.restarts
        self.driver.ensure_running()
        if fault.kind == "crash":  # the next batch, the first to read the chunk produced below
            arm(self.crash_dir, fault.point or "", (self.batch_in_flight() or 0) + 1)
        self.expected += produce_input(self.kafka, self.ctx.input_topic, self.chunk, first=self.produced,
                                       upstream=self.upstream)
        self.produced += self.chunk
        ended, batch = self._inject(fault)
        caught_up, last_change = None, time.monotonic()
        seen: tuple[int, int | None, int | None] | None = None
        reconnected = 0.0
        deadline = time.monotonic() + self.catch_up_s
        want = Counter(self.expected)
        while time.monotonic() < deadline:
            if fault.kind == "crash" and ended is None:
                where = fired_at(self.crash_dir, fault.point or "")
                if where is not None:
                    ended, batch = time.monotonic(), where.get("batch")
            self.driver.ensure_running()
            got = self.output()
            progress = (len(got), self.batch_in_flight(), self.batch_committed())
            if progress != seen:  # quiet means: no new output and no batch planned or committed
                seen, last_change = progress, time.monotonic()
            if not (want - Counter(got)) and self._idle() and self.driver.running_query():
                caught_up = caught_up or time.monotonic()
                if time.monotonic() - last_change > 1.0:  # settled: late duplicates would have shown
                    break
            quiet = time.monotonic() - last_change
            if quiet > self.quiet_s and self._idle():
                break  # nothing more is coming: what is missing is lost
            if self.kafka_output is not None and quiet > 10 and time.monotonic() - reconnected > 10:
                self.kafka_output.reconnect()
                reconnected = time.monotonic()
            time.sleep(0.3)
        if fault.kind == "crash" and ended is None:
            disarm(self.crash_dir, fault.point or "")
        verdict = compare(self.expected, self.output())
        start = ended if ended is not None else time.monotonic()
        recovery = max(0.0, round(caught_up - start, 1)) if caught_up is not None else float("nan")
        return FaultResult(str(fault), ended is not None, batch, self.query_restarts() - restarts_before,
                           self.driver.restarts - driver_before, recovery,
                           verdict.name, verdict.summary(3))

    def batch_committed(self) -> int | None:
        return _latest(Path(self.ctx.checkpoint) / "commits")

    def _idle(self) -> bool:
        """Spark has committed every batch it planned."""
        planned = self.batch_in_flight()
        return planned is not None and planned == self.batch_committed()

    def _inject(self, fault: Fault) -> tuple[float | None, int | None]:
        """Inject ``fault``; returns when it ended and the batch in flight (None, None for a crash
        point, which the wait loop sees fire)."""
        if fault.kind == "crash":
            return None, None
        time.sleep(fault.delay_s)
        batch = self.batch_in_flight()
        if fault.kind == "kill":
            self.driver.kill()
            return time.monotonic(), batch
        service = self.services.kafka if fault.kind.startswith("kafka") else self.services.postgres
        if fault.kind.endswith("-restart"):
            service.stop()
            time.sleep(fault.outage_s)
            service.start()
        else:
            service.disconnect()
            time.sleep(fault.outage_s)
            service.reconnect()
            service.wait_ready()
        return time.monotonic(), batch

    def finish(self) -> tuple[int | None, Verdict, list[str]]:
        """Stop the driver gracefully; returns its exit code, the verdict over all input, and
        what it left behind (prepared transactions, partitions with an open Kafka transaction)."""
        code = self.driver.stop()
        final = compare(self.expected, self.output())
        left = [f"prepared transaction {gid}" for gid in prepared_transactions(self.services.postgres.dsn)]
        if self.kafka_output is not None:
            left += [f"open transaction in {self.ctx.output}[{p}]" for p in self.kafka_output.open_transactions()]
            self.kafka_output.__exit__()
        return code, final, left


@dataclass(frozen=True)
class CampaignReport:
    pipeline: str
    seed: int
    guarantee: str
    results: list[FaultResult]
    final: str  # the verdict over all input after the driver stopped
    left_behind: list[str]
    log: str

    @property
    def passed(self) -> bool:
        return not self.left_behind and all(r.verdict in _ALLOWED[self.guarantee] for r in self.results) \
            and self.final in _ALLOWED[self.guarantee]

    @property
    def longest_recovery_s(self) -> float:
        return max((r.recovery_s for r in self.results if r.recovery_s == r.recovery_s), default=0.0)


_ALLOWED = {"exactly-once": {"exactly-once"}, "at-least-once": {"exactly-once", "duplicates"},
            "at-most-once": {"exactly-once", "LOSS"}}


def run_campaign(pipeline: str, services: Services, faults: int | list[Fault], seed: int = 1,
                 guarantee: str | None = None, progress: Callable[[int, int, FaultResult], None] | None = None,
                 chunk: int = CHUNK, per_batch: int = PER_BATCH, env: dict[str, str] | None = None,
                 work_dir: str | None = None, upstream: Upstream | None = None) -> CampaignReport:
    """Run ``pipeline`` under ``faults`` (a count drawn from ``seed``, or a given schedule) and
    check every verdict against ``guarantee`` (default: what the example promises, else
    exactly-once)."""
    example = EXAMPLES.get(pipeline)
    guarantee = guarantee or (example.guarantee if example else "exactly-once")
    if guarantee not in GUARANTEES:
        raise ConfigError(f"guarantee {guarantee!r}: choose one of {', '.join(GUARANTEES)}")
    plan = faults if isinstance(faults, list) else schedule(
        seed, faults, example.points if example else POINTS, network_cuts=services.backend == "containers")
    name = f"{pipeline.replace(':', '-').replace('.', '-')}-{seed}-{time.time_ns() % 10**9}"
    with _work(work_dir) as work:
        campaign = Campaign(pipeline, services, name, work, chunk, per_batch, env, upstream=upstream)
        results: list[FaultResult] = []
        try:
            for index, fault in enumerate(plan):
                results.append(campaign.run(fault))
                if progress is not None:
                    progress(index + 1, len(plan), results[-1])
        finally:
            code, final, left = campaign.finish()
        if code not in (0, None):
            left.append(f"driver exited with {code} when stopped")
        log = (work / "driver.log").read_text(errors="replace")[-4000:] if (work / "driver.log").exists() else ""
        return CampaignReport(pipeline, seed, guarantee, results, final.name, left, log)


@contextmanager
def _work(path: str | None) -> Iterator[Path]:
    if path:
        Path(path).mkdir(parents=True, exist_ok=True)
        yield Path(path)
        return
    with tempfile.TemporaryDirectory(prefix="oncekit-verify-") as work:
        yield Path(work)


def table(report: CampaignReport) -> str:
    """The campaign as a Markdown table, with the seed and schedule that reproduce it."""
    lines = [f"oncekit verify: pipeline {report.pipeline}, guarantee {report.guarantee}, seed {report.seed}, "
             f"{len(report.results)} faults",
             f"| {'#':>2} | {'fault':<46} | {'fired':<5} | {'batch':>5} | {'query restarts':>14} | "
             f"{'driver restarts':>15} | {'recovery s':>10} | {'verdict':<15} |",
             f"|{'-' * 4}|{'-' * 48}|{'-' * 7}|{'-' * 7}|{'-' * 16}|{'-' * 17}|{'-' * 12}|{'-' * 17}|"]
    for i, r in enumerate(report.results):
        batch = "" if r.batch is None else str(r.batch)
        lines.append(f"| {i:>2} | {r.fault:<46} | {'yes' if r.fired else 'no':<5} | {batch:>5} | "
                     f"{r.query_restarts:>14} | {r.driver_restarts:>15} | {r.recovery_s:>10.1f} | {r.verdict:<15} |")
    lines.append(f"final: {report.final}; left behind: {', '.join(report.left_behind) or 'nothing'}; "
                 f"longest recovery {report.longest_recovery_s:.1f} s")
    return "\n".join(lines)


def write_json(path: str, report: CampaignReport) -> None:
    data = {**asdict(report), "passed": report.passed, "longest_recovery_s": report.longest_recovery_s}
    data.pop("log")
    Path(path).write_text(json.dumps(data, indent=2))


if __name__ == "__main__":
    sys.exit(_driver_main(sys.argv[1]))

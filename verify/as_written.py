"""A user's job as written: a ``start(spark)`` function that reads Kafka through
:func:`~oncekit.kafka_stream`, starts one query through :func:`~oncekit.start_query`, and names its
own brokers, topics, tables and checkpoint. ``oncekit verify --pipeline module:start --input FILE``
runs it against the harness's services, unchanged.

In the job's driver process, before the job's module is imported, :func:`install` redirects those
two entry points (nothing else of the job changes: its parsing, state, protocols and options run as
written):

- ``kafka_stream`` reads the harness's input topic, from its earliest offset, at the harness's
  batch size, with the harness's client settings;
- ``start_query`` runs with the harness's checkpoint and trigger, writes each table and topic of its
  sink under a name of the run's own (:func:`redirect_sink`), creates those tables from the
  stream's schema, and records them for the harness (:class:`Targets`).

The harness judges the job against itself (:func:`run_job_campaign`): the user's records go in, in
as many chunks as there are faults, first to a run without faults (each chunk drained by an
``availableNow`` run of the job), then to a run with faults; after each chunk, what the faulted
run committed must equal what the clean run committed, as a multiset. The job's output must
therefore depend on its input only, not on where batches begin (see the verifying page).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
import subprocess
import time
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

from confluent_kafka import Producer
from psycopg import sql

from oncekit.connectors import KafkaConfig
from oncekit.connectors.kafka import produce_when_room
from oncekit.connectors.postgres import connect
from oncekit.core.errors import ConfigError, VerifyError
from oncekit.core.protocol import SinkConfig
from oncekit.verify.examples import PipelineContext
from oncekit.verify.io import KafkaOutput, prepared_transactions

DRAIN_TIMEOUT_S = 300.0
"""How long the clean run's ``availableNow`` run of one chunk may take."""

PARTITIONS = 2
"""Partitions of the input topic; record ``i`` of the input goes to partition ``i % 2`` in both runs."""


def takes_spark_only(function: Callable[..., Any]) -> bool:
    """Whether ``function`` is a job as written (one required parameter: the Spark session), not a
    pipeline under test (``start(spark, ctx)``)."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return False
    required = [p for p in parameters if p.default is inspect.Parameter.empty
                and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(required) == 1


def read_records(path: str) -> list[bytes]:
    """The job's input from the file ``path``: one record value per line (the line's end is not
    part of it; empty lines are skipped). ConfigError when it holds none or cannot be read."""
    try:
        records = [line for line in Path(path).read_bytes().splitlines() if line.strip()]
    except OSError as exc:
        raise ConfigError(f"--input {path}: cannot read it: {exc}") from exc
    if not records:
        raise ConfigError(f"--input {path}: no records in it (one record value per line)")
    return records


def job_records(pipeline: str, input_path: str | None) -> list[bytes] | None:
    """``oncekit verify``: the input of ``pipeline`` when it is a job as written (read from
    ``input_path``, which it then needs), None for a pipeline under test (which takes the
    harness's integers, and no ``input_path``). ConfigError naming what is missing."""
    from oncekit.verify.examples import EXAMPLES, resolve

    as_written = pipeline not in EXAMPLES and takes_spark_only(resolve(pipeline))
    if as_written and not input_path:
        raise ConfigError(f"pipeline {pipeline} is a job as written (start(spark)): give its input with --input FILE, "
                          "one record value per line")
    if not as_written and input_path:
        raise ConfigError(f"--input feeds a job as written (start(spark)); pipeline {pipeline} takes the harness's "
                          "input (start(spark, ctx))")
    return read_records(input_path) if as_written and input_path else None


# -- the driver process's side ----------------------------------------------------------------


def redirect_sink(config: SinkConfig, ctx: PipelineContext) -> SinkConfig:
    """``config`` pointed at the harness: its tables and topics (and dead letters) renamed
    ``<ctx.output>_<name>``, its sink id ``<ctx.output>-<id>``, the harness's DSN, brokers and
    client settings. A fan-out's targets each so."""
    from oncekit.core.fanout import FanOutConfig
    from oncekit.sinks.kafka.config import KafkaSinkConfig
    from oncekit.sinks.postgres.config import PostgresSinkConfig

    sink_id = f"{ctx.output}-{config.sink_id}"
    if isinstance(config, FanOutConfig):
        return dataclasses.replace(config, sink_id=sink_id,
                                   targets={route: redirect_sink(c, ctx) for route, c in config.targets.items()})
    if isinstance(config, PostgresSinkConfig):
        dead = config.dead_letter_table and harness_name(ctx, config.dead_letter_table)
        return dataclasses.replace(config, sink_id=sink_id, dsn=ctx.dsn, table=harness_name(ctx, config.table),
                                   dead_letter_table=dead)
    if isinstance(config, KafkaSinkConfig):
        dead = config.dead_letter_topic and harness_name(ctx, config.dead_letter_topic)
        return dataclasses.replace(config, sink_id=sink_id, bootstrap_servers=ctx.bootstrap_servers,
                                   topic=harness_name(ctx, config.topic), client=dict(ctx.kafka_client),
                                   dead_letter_topic=dead)
    raise ConfigError(f"oncekit verify runs jobs whose sinks are the kit's (postgres_sink, kafka_sink, fan_out); "
                      f"this one's is {type(config).__name__}")


def harness_name(ctx: PipelineContext, name: str) -> str:
    """The run's own name for the job's table or topic ``name`` (a table's schema is dropped)."""
    return f"{ctx.output}_{name.rsplit('.', 1)[-1]}"


_PG_TYPES = {"string": "text", "int": "integer", "bigint": "bigint", "smallint": "smallint", "tinyint": "smallint",
             "double": "double precision", "float": "real", "boolean": "boolean", "timestamp": "timestamptz",
             "timestamp_ntz": "timestamp", "date": "date", "binary": "bytea"}


def column_type(column: str, spark_type: str) -> str:
    """The PostgreSQL type of a table the harness creates for a stream column of ``spark_type``
    (Spark's simple string). ConfigError for a type it does not map."""
    if re.fullmatch(r"decimal\(\d+,\d+\)", spark_type):
        return spark_type.replace("decimal", "numeric")
    if spark_type not in _PG_TYPES:
        raise ConfigError(f"oncekit verify creates the job's tables from the stream's schema; column {column!r} is "
                          f"{spark_type}, which it does not map to a PostgreSQL type: cast it in the job "
                          f"({', '.join(sorted(_PG_TYPES))} or decimal(p,s))")
    return _PG_TYPES[spark_type]


@dataclasses.dataclass(frozen=True)
class Target:
    """A table or topic the job's query writes: ``kind`` postgres or kafka, the job's ``name`` for
    it, the run's ``harness`` name, and (a table) the ``columns`` the harness reads back."""

    kind: str
    name: str
    harness: str
    columns: tuple[str, ...] = ()


class Targets:
    """``<checkpoint>.targets``: what the job's query writes, recorded by its driver process when
    the query starts, read by the harness to read the output back."""

    def __init__(self, checkpoint: str) -> None:
        self.path = Path(checkpoint + ".targets")

    def write(self, targets: list[Target]) -> None:
        self.path.write_text(json.dumps([dataclasses.asdict(t) for t in targets]))

    def read(self) -> list[Target]:
        if not self.path.exists():
            return []
        return [Target(**{**t, "columns": tuple(t["columns"])}) for t in json.loads(self.path.read_text())]


def prepare_targets(frame: Any, job_sink: SinkConfig, sink: SinkConfig, dsn: str) -> list[Target]:
    """Create the tables of ``sink`` (``job_sink`` redirected) from ``frame``'s schema (a table
    keyed by its sink's key columns); returns every target, for :class:`Targets`."""
    from oncekit.core.fanout import FanOutConfig
    from oncekit.sinks.kafka.config import KafkaSinkConfig
    from oncekit.sinks.postgres.config import PostgresSinkConfig

    types = {field.name: field.dataType.simpleString() for field in frame.schema.fields}
    pairs = list(zip(job_sink.targets.values(), sink.targets.values(), strict=True)) \
        if isinstance(job_sink, FanOutConfig) and isinstance(sink, FanOutConfig) else [(job_sink, sink)]
    route = sink.route_column if isinstance(sink, FanOutConfig) else None
    found: list[Target] = []
    for job_target, target in pairs:
        if isinstance(target, KafkaSinkConfig) and isinstance(job_target, KafkaSinkConfig):
            found.append(Target("kafka", job_target.topic, target.topic))
            continue
        assert isinstance(target, PostgresSinkConfig) and isinstance(job_target, PostgresSinkConfig)
        columns = target.columns or tuple(c for c in types if c != route)
        missing = [c for c in columns if c not in types]
        if missing:
            raise ConfigError(f"table {job_target.table}: the stream has no column {', '.join(missing)}")
        definition = [sql.SQL("{} {}").format(sql.Identifier(c), sql.SQL(column_type(c, types[c]))) for c in columns]
        if target.key_columns:
            definition.append(sql.SQL("PRIMARY KEY ({})").format(sql.SQL(", ").join(map(sql.Identifier, target.key_columns))))
        with connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE TABLE IF NOT EXISTS {} ({})").format(
                sql.Identifier(target.table), sql.SQL(", ").join(definition)))
        found.append(Target("postgres", job_target.table, target.table, columns))
    return found


def install(ctx: PipelineContext) -> None:
    """Driver process of a job as written, before its module is imported: redirect
    :func:`~oncekit.kafka_stream` and :func:`~oncekit.start_query` to the harness, as the module
    docstring says. Both are replaced in the modules that own them, which every import of them
    (``from oncekit import ...`` included) reads."""
    import oncekit.core.spark.query as query_module
    import oncekit.sources.kafka as source_module

    read, start = source_module.kafka_stream, query_module.start_query
    started: list[str] = []

    def kafka_stream(spark: Any, bootstrap_servers: str, topics: Any = None, *, connector: str = "oncekit",
                     **options: Any) -> Any:
        named = [topics] if isinstance(topics, str) else list(topics or [])
        if len(named) != 1 or "," in named[0] or "subscribePattern" in options:
            raise ConfigError(f"oncekit verify feeds a job one input topic; this job reads "
                              f"{named or options.get('subscribePattern')!r}")
        kept: dict[str, Any] = {k: v for k, v in options.items() if not k.startswith("kafka.")
                                and k not in ("max_offsets_per_trigger", "starting_offsets")}
        kept.update({f"kafka.{k}": str(v) for k, v in ctx.kafka_client.items()})
        return read(spark, ctx.bootstrap_servers, ctx.input_topic, connector=connector, starting_offsets="earliest",
                    max_offsets_per_trigger=ctx.max_offsets_per_trigger, **kept)

    def start_query(frame: Any, sink: SinkConfig, checkpoint: str, **keywords: Any) -> Any:
        if started and checkpoint != started[0]:  # the same one again: a restart of the job
            raise ConfigError(f"oncekit verify runs a job that starts one query; this one started a second, "
                              f"checkpointed at {checkpoint} (the first at {started[0]})")
        started[:1] = [checkpoint]
        redirected = redirect_sink(sink, ctx)
        Targets(ctx.checkpoint).write(prepare_targets(frame, sink, redirected, ctx.dsn))
        return start(frame, redirected, ctx.checkpoint, **{**keywords, "trigger": ctx.trigger})

    source_module.kafka_stream = kafka_stream
    query_module.start_query = start_query


# -- the harness's side -----------------------------------------------------------------------


class JobInput:
    """The user's ``records`` in ``chunks`` chunks (the last ones empty when there are fewer records), produced into a run's input topic one chunk
    at a time (each in one Kafka transaction; record ``i`` into partition ``i % 2``)."""

    def __init__(self, records: list[bytes], chunks: int) -> None:
        size = -(-len(records) // max(1, chunks))
        numbered = list(enumerate(records))
        self.chunks = [numbered[i * size:(i + 1) * size] for i in range(max(1, chunks))]

    def produce(self, kafka: KafkaConfig, topic: str, index: int) -> None:
        producer = Producer(kafka.settings(transactional_id=f"input-{topic}", linger_ms=5))
        producer.init_transactions(30)
        producer.begin_transaction()
        for i, value in self.chunks[index]:
            produce_when_room(producer, topic, value=value, partition=i % PARTITIONS)
        producer.commit_transaction(30)


class JobOutput:
    """What one run of a job as written committed, read back through its :class:`Targets`: a
    table's rows as ``("table", name, *values)``, a topic's values as ``("topic", name, value)``.
    Called by the campaign like :class:`~oncekit.verify.io.PipelineOutput`; ``wanted`` is what
    the clean run committed after as many chunks (:attr:`expected`, set by the harness)."""

    def __init__(self, kafka: KafkaConfig, dsn: str, checkpoint: str, prefix: str) -> None:
        self.kafka_config, self.dsn, self.prefix = kafka, dsn, prefix
        self.targets = Targets(checkpoint)
        self.topics: dict[str, KafkaOutput] = {}
        self.expected: list[list[Hashable]] = []
        self.produced = 0
        self.kafka: KafkaOutput | None = None  # the campaign reconnects a topic's reader: the first topic's

    def read(self) -> list[Hashable]:
        records: list[Hashable] = []
        for target in self.targets.read():
            if target.kind == "kafka":
                if target.harness not in self.topics:
                    self.topics[target.harness] = KafkaOutput(self.kafka_config, target.harness)
                    self.kafka = self.kafka or self.topics[target.harness]
                records += [("topic", target.name, v) for v in self.topics[target.harness].read(0.2)]
                continue
            with connect(self.dsn) as conn:
                rows = conn.execute(sql.SQL("SELECT {} FROM {}").format(
                    sql.SQL(", ").join(map(sql.Identifier, target.columns)), sql.Identifier(target.harness))).fetchall()
            records += [("table", target.name, *(v if isinstance(v, Hashable) else repr(v) for v in row))
                        for row in rows]
        return records

    def wanted(self, ids: object = None) -> list[Hashable]:
        return self.expected[self.produced - 1] if self.produced else []

    def left_open(self, checkpoint: str | None = None) -> list[str]:
        left = [f"prepared transaction {gid}" for gid in prepared_transactions(self.dsn, self.prefix)]
        for topic, output in self.topics.items():
            left += [f"open transaction in {topic}[{p}]" for p in output.open_transactions()]
        return left

    def close(self) -> None:
        for output in self.topics.values():
            output.__exit__()


def clean_run(pipeline: str, job_input: JobInput, ctx: PipelineContext, kafka: KafkaConfig, work: Path,
              progress: Callable[[str], None] = lambda line: None) -> list[list[Hashable]]:
    """The job without faults: each chunk produced into ``ctx.input_topic`` and drained by an
    ``availableNow`` run of the job in a driver process; what it committed after each chunk."""
    from oncekit.verify.driver import LOG_TAIL_LINES, start_driver
    from oncekit.core.stacks import log_tail

    (work / "crash").mkdir(parents=True, exist_ok=True)
    output = JobOutput(kafka, ctx.dsn, ctx.checkpoint, ctx.output)
    log = work / "driver.log"
    snapshots: list[list[Hashable]] = []
    try:
        for index in range(len(job_input.chunks)):
            job_input.produce(kafka, ctx.input_topic, index)
            started = time.monotonic()
            process = start_driver(pipeline, ctx, str(work / "crash"), drain=True, log=log, as_written=True)
            try:
                code = process.wait(DRAIN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                code = None
            if code != 0:
                raise VerifyError(f"pipeline {pipeline}: its clean run of chunk {index + 1} ended with exit {code} "
                                  f"(after {time.monotonic() - started:.0f} s); its log ends: "
                                  f"{log_tail(log, LOG_TAIL_LINES)}")
            time.sleep(1.0)  # a topic's last commit markers
            snapshots.append(output.read())
            progress(f"clean run: chunk {index + 1}/{len(job_input.chunks)}, {len(snapshots[-1])} records committed "
                     f"({time.monotonic() - started:.0f} s)")
    finally:
        output.close()
    return snapshots

"""Pipelines under test: the kit's examples, and how a user's pipeline is found.

A *pipeline under test* is a function ``(spark, ctx: PipelineContext) -> query`` that reads
``ctx.input_topic`` and carries each input value (a decimal integer) to its output once: into
column ``id`` of table ``ctx.output``, as the value of a record in topic ``ctx.output``, or
(kind ``fan-out``) into both. The
kit's own example pipelines are named in :data:`EXAMPLES`; a user's is ``module:function``.
"""

from __future__ import annotations

import importlib
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from oncekit.connectors import KafkaConfig
from oncekit.core.crash import POINTS
from oncekit.core.errors import ConfigError

if TYPE_CHECKING:
    from oncekit.core.protocol import SinkConfig
    from oncekit.core.spark.query import Trigger
    from oncekit.sinks.kafka.config import KafkaProtocol
    from oncekit.sinks.postgres.config import PostgresProtocol

COUNT, PER_BATCH = 1000, 300  # the one-shot tests: four batches; both partitions have rows in every batch


@dataclass(frozen=True)
class Example:
    """One of the kit's example pipelines: integers from Kafka into one sink."""

    kind: str  # "postgres", "kafka" or "fan-out" (both: a table and a topic of one name)
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
    # one query, one checkpoint, two sinks: every record into the table and into the topic
    "fan-out-postgres-kafka": Example("fan-out", "two-phase-commit+transactional", "exactly-once"),
    # the same with the topic's batches published after the checkpoint (staged files): the soak's
    # default, since it has every kind of state the kit keeps (journal, staged files, prepared
    # transactions, marker rows, marker topics)
    "fan-out-postgres-kafka-wal": Example("fan-out", "two-phase-commit+write-ahead-log", "exactly-once"),
}


def _trigger(**keywords: Any) -> Trigger:
    from oncekit.core.spark.query import Trigger  # pyspark only once a pipeline runs

    return Trigger(**keywords)


@dataclass(frozen=True)
class PipelineContext:
    """What a pipeline under test is given: where its input is, where its output goes, and the
    checkpoint it must use (the harness watches it and restarts from it)."""

    bootstrap_servers: str
    input_topic: str
    output: str
    checkpoint: str
    dsn: str = field(default="", repr=False)
    trigger: Trigger = field(default_factory=lambda: _trigger(processing_time="500 milliseconds"))
    max_offsets_per_trigger: int = PER_BATCH
    kafka_client: dict[str, str] = field(default_factory=dict, repr=False)  # security settings: secret

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PipelineContext:
        """The context ``dataclasses.asdict`` made into ``data`` (as JSON crosses to a driver
        process), its trigger made a :class:`~oncekit.Trigger` again."""
        return cls(**{**data, "trigger": _trigger(**data["trigger"])}) if "trigger" in data else cls(**data)

    @property
    def kafka(self) -> KafkaConfig:
        """The Kafka cluster and the client settings (security) every client needs."""
        return KafkaConfig(self.bootstrap_servers, self.kafka_client)


def integers(spark: Any, kafka: KafkaConfig, topic: str, per_batch: int = PER_BATCH, starting: str = "earliest",
             connector: str = "oncekit", max_partitions: int | None = None) -> Any:
    """The stream: one row (id, payload) per well-formed input record; malformed ones are dropped.
    ``connector`` and ``max_partitions``: who reads the topic, and in how many tasks at most
    (:func:`oncekit.sources.kafka.kafka_stream`)."""
    from oncekit.sources.kafka import kafka_stream

    client: dict[str, Any] = {f"kafka.{k}": str(v) for k, v in kafka.client.items()}
    return kafka_stream(spark, kafka.bootstrap_servers, topic, max_offsets_per_trigger=per_batch,
                        starting_offsets=starting, connector=connector, max_partitions=max_partitions,
                        **client).selectExpr(
        "TRY_CAST(CAST(value AS STRING) AS INT) AS id", "CAST(value AS STRING) AS payload").where("id IS NOT NULL")


def example_sink(sink: str, kafka: KafkaConfig, dsn: str, target: str) -> SinkConfig:
    from oncekit.core.fanout import fan_out
    from oncekit.sinks.kafka import kafka_sink
    from oncekit.sinks.postgres import postgres_sink

    example = EXAMPLES[sink]
    if example.kind == "fan-out":
        table, topic = example.protocol.split("+")
        # The examples' protocols are the sinks' own names (their configs check them).
        return fan_out({"table": postgres_sink(dsn, target, cast("PostgresProtocol", table), columns=("id", "payload")),
                        "topic": kafka_sink(kafka.bootstrap_servers, target, cast("KafkaProtocol", topic),
                                            columns=("key", "value"), client=dict(kafka.client))})
    if example.kind == "kafka":
        return kafka_sink(kafka.bootstrap_servers, target, cast("KafkaProtocol", example.protocol), client=dict(kafka.client))
    return postgres_sink(dsn, target, cast("PostgresProtocol", example.protocol),
                         key_columns=("id",) if example.protocol == "idempotent" else ())


def example_frame(sink: str, spark: Any, kafka: KafkaConfig, topic: str, per_batch: int = PER_BATCH) -> Any:
    starting = "latest" if EXAMPLES[sink].discards_checkpoint else "earliest"
    frame = integers(spark, kafka, topic, per_batch, starting)
    if EXAMPLES[sink].kind == "fan-out":
        return frame.selectExpr("id", "payload", "CAST(id AS STRING) AS key", "CAST(id AS STRING) AS value",
                                "explode(array('table', 'topic')) AS target")
    return frame.selectExpr("CAST(id AS STRING) AS value") if EXAMPLES[sink].kind == "kafka" else frame


def start_example(sink: str, spark: Any, ctx: PipelineContext) -> Any:
    """Start the kit's example pipeline ``sink`` (a key of :data:`EXAMPLES`) as ``ctx`` says."""
    from oncekit.core.spark.query import start_query

    kafka = ctx.kafka
    if EXAMPLES[sink].discards_checkpoint:  # the operator's mistake this example stands for
        shutil.rmtree(ctx.checkpoint, ignore_errors=True)
    return start_query(example_frame(sink, spark, kafka, ctx.input_topic, ctx.max_offsets_per_trigger),
                       example_sink(sink, kafka, ctx.dsn, ctx.output), ctx.checkpoint, trigger=ctx.trigger)


def sink_kind(pipeline: str) -> str:
    """Where pipeline ``pipeline``'s output is read: an example's kind, or the ``kind`` attribute
    a user's function may carry (default postgres)."""
    if pipeline in EXAMPLES:
        return EXAMPLES[pipeline].kind
    kind = str(getattr(resolve(pipeline), "kind", "postgres"))
    if kind not in ("postgres", "kafka", "fan-out"):
        raise ConfigError(f"pipeline {pipeline}: kind must be 'postgres', 'kafka' or 'fan-out', not {kind!r}")
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

"""A replayable Kafka source for Spark, over confluent-kafka, with offsets in Spark's checkpoint.

Spark plans every micro-batch as a range of offsets per topic-partition and writes the range to
its offset log before the batch runs, so a batch that is re-run after a crash reads exactly the
same records. Consumer-group offsets are never used for recovery.

Use it as ``spark.readStream.format("oncekit-kafka")`` after :func:`register` (or through
:class:`KafkaSourceBuilder`). Tasks yield pyarrow RecordBatches, not rows.
"""

from __future__ import annotations

import itertools
import json
import logging
import re
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from oncekit.connectors.kafka import (CLIENTS, READ_AHEAD, RECONNECT, KafkaConfig, attempt_timeout,
                                      refuse_java_client_settings, remember_cluster_read, retrying,
                                      security_settings)
from oncekit.connectors.kafka_admin import check_access
from oncekit.connectors.redact import redact_config
from oncekit.core.errors import ConfigError, DataLossError
from oncekit.sources.warm_up import WARM_UP_SERVERS

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

logger = logging.getLogger(__name__)

FORMAT = "oncekit-kafka"
SCHEMA = (
    "key binary, value binary, topic string, partition int, offset bigint, timestamp timestamp, timestampType int"
)
HEADERS_FIELD = "headers array<struct<key: string, value: binary>>"

# Offsets as Spark stores them: {topic: {partition (as str, JSON keys are strings): offset}}.
Offsets = dict[str, dict[str, int]]


@dataclass(frozen=True)
class KafkaSourceOptions:
    """The source's options, parsed once from Spark's string options.

    ``kafka.*`` options pass through to librdkafka (``kafka.bootstrap.servers`` is required).
    """

    client: Mapping[str, str]
    topics: tuple[str, ...]
    topic_pattern: str | None = None
    starting_offsets: str = "earliest"
    starting_timestamp_ms: int | None = None
    ending_offsets: str = "latest"
    max_offsets_per_trigger: int | None = None
    fail_on_data_loss: bool = True
    include_headers: bool = False
    poll_timeout_s: float = 120.0
    consumer_group: str | None = None
    batch_size: int = 10_000
    max_partitions: int | None = None
    """At most this many tasks read a batch (option ``maxPartitions``): the topic-partitions'
    ranges are grouped, each task reading its group together on one consumer; None, a task per
    topic-partition with records to read."""

    def __repr__(self) -> str:
        return f"KafkaSourceOptions(topics={self.topics!r}, client={redact_config(self.client)!r})"

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> KafkaSourceOptions:
        lowered = {key.lower(): value for key, value in options.items()}
        client = {key[len("kafka."):]: value for key, value in lowered.items() if key.startswith("kafka.")}
        if "bootstrap.servers" not in client:
            raise ConfigError(f"{FORMAT}: option kafka.bootstrap.servers is required")
        refuse_java_client_settings(client, f"{FORMAT} source", prefix="kafka.")
        if "assign" in lowered:
            raise ConfigError(f"{FORMAT} source: the option assign (chosen partitions) is not supported; give subscribe "
                              "(topics) or subscribePattern (a regex): the source reads every partition of them")
        client.setdefault("isolation.level", "read_committed")
        if client["isolation.level"] not in ("read_committed", "read_uncommitted"):
            raise ConfigError(f"{FORMAT}: kafka.isolation.level must be read_committed or read_uncommitted")
        topics = tuple(t.strip() for t in lowered.get("subscribe", "").split(",") if t.strip())
        pattern = lowered.get("subscribepattern") or None
        if bool(topics) == bool(pattern):
            raise ConfigError(f"{FORMAT}: give one of the options subscribe (comma-separated topics) or subscribePattern (a regex)")
        if pattern is not None:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ConfigError(f"{FORMAT}: subscribePattern {pattern!r} is not a regular expression: {exc}") from exc
        timestamp = lowered.get("startingtimestamp")
        if timestamp is not None and not timestamp.isdigit():
            raise ConfigError(f"{FORMAT}: startingTimestamp must be milliseconds since the epoch, got {timestamp!r}")
        max_offsets = lowered.get("maxoffsetspertrigger")
        try:
            limit = int(max_offsets) if max_offsets else None
        except ValueError as exc:
            raise ConfigError(f"{FORMAT}: maxOffsetsPerTrigger must be a whole number, got {max_offsets!r}") from exc
        if limit is not None and limit <= 0:
            raise ConfigError(f"{FORMAT}: maxOffsetsPerTrigger must be positive, got {limit}")
        tasks = lowered.get("maxpartitions")
        if tasks is not None and not (tasks.isdigit() and int(tasks) > 0):
            raise ConfigError(f"{FORMAT}: maxPartitions must be a positive whole number, got {tasks!r}")
        return cls(
            client=client,
            topics=topics,
            topic_pattern=pattern,
            starting_offsets=lowered.get("startingoffsets", "earliest"),
            starting_timestamp_ms=int(timestamp) if timestamp is not None else None,
            ending_offsets=lowered.get("endingoffsets", "latest"),
            max_offsets_per_trigger=limit,
            fail_on_data_loss=lowered.get("failondataloss", "true").lower() != "false",
            include_headers=lowered.get("includeheaders", "false").lower() == "true",
            poll_timeout_s=float(lowered.get("polltimeoutms", "120000")) / 1000,
            consumer_group=lowered.get("consumergroup") or None,
            max_partitions=int(tasks) if tasks is not None else None,
        )

    def consumer(self, **extra: Any) -> Consumer:
        """A new consumer with these client settings; assign() only, it never joins a group."""
        return Consumer({
            **RECONNECT,
            **READ_AHEAD,
            "group.id": "oncekit-source",  # required by librdkafka; assign() never joins the group
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "enable.partition.eof": False,
            # An offset the log no longer holds is an error to see (data loss), never a jump.
            "auto.offset.reset": "error",
            **self.client,  # the user's settings win over ours
            **extra,
        })

    @property
    def kafka(self) -> KafkaConfig:
        """The same client settings as the kit's own Kafka configuration."""
        rest = {key: value for key, value in self.client.items() if key != "bootstrap.servers"}
        return KafkaConfig(self.client["bootstrap.servers"], rest)

    @property
    def pool_key(self) -> tuple[str, ...]:
        """What makes this source's consumers interchangeable in the process's pool: the settings."""
        return ("source", *(f"{key}={value}" for key, value in sorted(self.client.items())))

    def borrowed_consumer(self) -> AbstractContextManager[Consumer]:
        """A consumer of this process's pool for a ``with`` block: Spark reuses its Python workers
        across tasks and batches, and the driver-side reader lives as long as the query, so a
        consumer keeps its broker connections and metadata instead of paying for them per task.
        Closed, not given back, if the block raises."""
        return CLIENTS.borrowed(self.pool_key, self.consumer)


def _resolve(spec: str, watermarks: Mapping[tuple[str, int], tuple[int, int]], which: str) -> Offsets:
    """Offsets for ``earliest``, ``latest`` or per-partition JSON (-2 earliest, -1 latest), the
    convention of Spark's own Kafka source."""
    explicit: dict[str, dict[str, int]] = {}
    if spec not in ("earliest", "latest"):
        try:
            explicit = {t: {str(p): int(o) for p, o in parts.items()} for t, parts in json.loads(spec).items()}
        except (ValueError, AttributeError) as exc:
            raise ConfigError(f"{FORMAT}: {which} must be earliest, latest or JSON like {{\"topic\":{{\"0\":42}}}}") from exc
    out: Offsets = {}
    for (topic, partition), (low, high) in watermarks.items():
        given = explicit.get(topic, {}).get(str(partition))
        if given is None:
            given = -1 if spec == "latest" else -2
        out.setdefault(topic, {})[str(partition)] = low if given == -2 else high if given == -1 else given
    return out


EARLIEST, LATEST = -2, -1
"""The timestamps Kafka's ListOffsets reads as a partition's first offset and its end."""


def watermarks(options: KafkaSourceOptions) -> dict[tuple[str, int], tuple[int, int]]:
    """(low, high) per partition of the subscribed topics; with read_committed, high is the last
    stable offset, so open transactions are never planned into a batch. Called by the driver-side
    reader at every trigger, on a consumer of the process's pool. A broker that restarts delays
    the answer: each attempt (:func:`_watermarks_once`) asks on a consumer of its own."""
    names = ", ".join(options.topics) or options.topic_pattern
    attempts = itertools.count()
    try:
        return retrying(f"{FORMAT}: watermarks of {names}",
                        lambda: _watermarks_once(options, attempt_timeout(next(attempts))))
    except KafkaException:
        check_access(options.kafka)  # a refused password or certificate says so, not "transport failure"
        raise


def _watermarks_once(options: KafkaSourceOptions, timeout_s: float) -> dict[tuple[str, int], tuple[int, int]]:
    """One attempt of :func:`watermarks`, each request within ``timeout_s``; the consumer of an
    attempt that failed is closed, not pooled, so the next attempt connects afresh."""
    with options.borrowed_consumer() as consumer:
        metadata = consumer.list_topics(timeout=timeout_s)
        wanted: list[tuple[str, int]] = []
        topics = options.topics
        if options.topic_pattern is not None:
            # A pattern picks up topics created after the query started, as Spark's own source does.
            topics = tuple(sorted(t for t in metadata.topics if re.fullmatch(options.topic_pattern, t)))
        for topic in topics:
            described = metadata.topics.get(topic)
            if described is None or (described.error is not None
                                     and described.error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART):
                raise ConfigError(f"{FORMAT}: topic {topic!r} does not exist")
            if described.error is not None:  # a leader on its way back: the next attempt asks again
                raise KafkaException(described.error)
            wanted += [(topic, partition) for partition in sorted(described.partitions)]
        # Two requests per leader broker for all partitions, where get_watermark_offsets asks per
        # partition. Under read_committed, LATEST is the last stable offset.
        low, high = (_offsets_at(consumer, wanted, timestamp, timeout_s) for timestamp in (EARLIEST, LATEST))
        return {key: (low[key], high[key]) for key in wanted}


def _offsets_at(consumer: Consumer, partitions: Sequence[tuple[str, int]], timestamp_ms: int,
                timeout_s: float) -> dict[tuple[str, int], int]:
    """Per partition, Kafka's ListOffsets answer for ``timestamp_ms`` (:data:`EARLIEST`,
    :data:`LATEST`, or a time: the first offset at or after it, -1 when there is none), in the
    consumer's isolation level, one request per leader; KafkaException for a partition's error."""
    found = consumer.offsets_for_times([TopicPartition(t, p, timestamp_ms) for t, p in partitions], timeout=timeout_s)
    failed = next((answer.error for answer in found if answer.error is not None), None)
    if failed is not None:
        raise KafkaException(failed)
    return {(answer.topic, answer.partition): answer.offset for answer in found}


def check_partitions(options: KafkaSourceOptions, start: Offsets, marks: Mapping[tuple[str, int], tuple[int, int]]) -> None:
    """Refuse to plan a batch when a partition the checkpoint has read from is gone (a topic
    deleted and recreated with fewer partitions, or a savepoint restored against another
    cluster): its unread records, and where the rest of the topic stands, are no longer known.
    Partitions added since are read from offset 0 (in :func:`_ranges`). Called by the
    driver-side reader when it plans a batch; a warning only with ``failOnDataLoss=false``."""
    gone = sorted((topic, int(partition)) for topic, partitions in start.items() for partition in partitions
                  if (topic, int(partition)) not in marks)
    if not gone:
        return
    topics = sorted({topic for topic, _ in gone})
    now = {topic: sum(1 for t, _ in marks if t == topic) for topic in topics}
    lost = "; ".join(f"topic {topic} has {now[topic]} partitions, the checkpoint read from partitions "
                     f"{', '.join(str(p) for t, p in gone if t == topic)} beyond them" for topic in topics)
    if options.fail_on_data_loss:
        raise DataLossError(f"{FORMAT}: {lost}. Fewer partitions than the checkpoint knows cannot continue exactly once; "
                            f"restore into a topic with as many partitions, or a new checkpoint (failOnDataLoss=false skips them)")
    logger.warning("%s: %s; skipped", FORMAT, lost)


CONNECTORS = ("oncekit", "spark")
SPARK_CONNECTOR_PACKAGE = "org.apache.spark:spark-sql-kafka-0-10_2.13"
"""The Maven coordinates of Spark's own Kafka connector, without the version (the job's Spark's)."""


def kafka_stream(
    spark: SparkSession,
    bootstrap_servers: str,
    topics: str | Sequence[str] | None = None,
    *,
    max_offsets_per_trigger: int | None = None,
    starting_offsets: str = "earliest",
    connector: str = "oncekit",
    max_partitions: int | None = None,
    **options: str,
) -> DataFrame:
    """The typed builder: a streaming DataFrame over ``topics``.

    ``connector`` says who reads: ``"oncekit"``, this module's source (registered first), or
    ``"spark"``, Spark's own (``format("kafka")``; ``org.apache.spark:spark-sql-kafka-0-10_2.13`` of
    the job's Spark version on its classpath: ``--packages`` or ``spark.jars.packages``), reading
    with ``kafka.isolation.level=read_committed`` unless ``options`` say otherwise. Both keep
    their offset ranges in Spark's checkpoint; Spark's reads without a Python worker, and may give
    a topic-partition to another task when it plans a batch again after a restart, so behind it
    :func:`~oncekit.core.spark.query.start_query` spreads the rows over a sink that commits per
    task (the Kafka ``transactional`` protocol) by a hash of their values.

    :param spark: the job's session.
    :param bootstrap_servers: the brokers, ``host:port[,host:port...]``.
    :param topics: the topic, or topics, to read (Spark's ``subscribe``); None with the option
        ``subscribePattern`` (a regex) in ``options`` instead, which takes in the topics that
        match as they appear. Spark's ``assign`` (chosen partitions) is refused: the source reads
        every partition of its topics.
    :param max_offsets_per_trigger: at most this many records per batch, over all partitions
        (Spark's ``maxOffsetsPerTrigger``); None reads all there is.
    :param starting_offsets: where a new checkpoint's first batch starts: ``earliest`` (the
        default, unlike Spark's ``latest``, so that a pipeline's first run reads what the topic
        already holds), ``latest``, or per-partition JSON as in Spark. Once the checkpoint has a
        batch, its offsets decide.
    :param connector: who reads: ``"oncekit"`` or ``"spark"`` (above).
    :param max_partitions: (``"oncekit"`` only) at most this many tasks read a batch, each a
        group of topic-partitions read together by one consumer (the option ``maxPartitions``); None
        is the session's default parallelism (its cores) where the session can tell it (not
        from a Spark Connect client: a task per topic-partition there). A batch's tasks write
        its sink, and a task costs the sink a transaction, a marker or a staged file, so a topic
        of many partitions costs less per batch with fewer, larger tasks. The count is part of
        the query's plan: a restart with another count while a batch is half-committed by a sink
        that commits in its tasks is refused (see "A half-committed batch is replayed by the
        plan that planned it").
    :param options: further source options, spelled as Spark's Kafka source spells them
        (``includeHeaders``, ``kafka.security.protocol``...).
    :returns: a streaming DataFrame with Spark's Kafka columns (``key``, ``value``, ``topic``,
        ``partition``, ``offset``, ``timestamp``, ``timestampType``).
    """
    if connector not in CONNECTORS:
        raise ConfigError(f"kafka_stream: connector {connector!r} is not one of {', '.join(CONNECTORS)}")
    if (topics is None) == ("subscribePattern" not in options):
        raise ConfigError("kafka_stream: give the topics, or subscribePattern='<regex>' as an option, not both")
    if connector == "oncekit":
        from oncekit.core.spark.session import default_parallelism

        register(spark)
        tasks = max_partitions if max_partitions is not None else default_parallelism(spark)
        if tasks is not None:
            options = {"maxPartitions": str(tasks), **options}
        if bootstrap_servers != WARM_UP_SERVERS:  # the cluster the job's status page asks (oncekit run --ui)
            remember_cluster_read(KafkaConfig(bootstrap_servers, security_settings(options)))
    else:
        if max_partitions is not None:
            raise ConfigError("kafka_stream: max_partitions groups the kit's source's tasks; Spark's own source "
                              "(connector='spark') has minPartitions instead")
        options = {"kafka.isolation.level": "read_committed", **options}
    reader = (
        spark.readStream.format(FORMAT if connector == "oncekit" else "kafka")
        .option("kafka.bootstrap.servers", bootstrap_servers)
        .option("startingOffsets", starting_offsets)
    )
    if topics is not None:
        reader = reader.option("subscribe", topics if isinstance(topics, str) else ",".join(topics))
    if max_offsets_per_trigger is not None:
        reader = reader.option("maxOffsetsPerTrigger", str(max_offsets_per_trigger))
    try:
        return reader.options(**options).load()
    except Exception as exc:
        if connector == "spark" and "DATA_SOURCE_NOT_FOUND" in str(exc):
            raise ConfigError(f"kafka_stream(connector='spark'): Spark's Kafka connector is not on the classpath; "
                              f"start the job with --packages {SPARK_CONNECTOR_PACKAGE}:{spark.version} (or set "
                              f"spark.jars.packages), or read with connector='oncekit'") from None
        raise


def offsets_for_timestamp(options: KafkaSourceOptions, marks: Mapping[tuple[str, int], tuple[int, int]],
                          timestamp_ms: int) -> Offsets:
    """Per partition, the first offset whose record timestamp is at or after ``timestamp_ms``
    (the partition's end when there is none)."""
    with options.borrowed_consumer() as consumer:
        found = _offsets_at(consumer, list(marks), timestamp_ms, 30)
    out: Offsets = {}
    for (topic, partition), offset in found.items():
        out.setdefault(topic, {})[str(partition)] = offset if offset >= 0 else marks[(topic, partition)][1]
    return out


def starting_offsets(options: KafkaSourceOptions, marks: Mapping[tuple[str, int], tuple[int, int]]) -> Offsets:
    """Where a new query starts: ``startingTimestamp`` if given, else ``startingOffsets``."""
    if options.starting_timestamp_ms is not None:
        return offsets_for_timestamp(options, marks, options.starting_timestamp_ms)
    return _resolve(options.starting_offsets, marks, "startingOffsets")


def register(spark: SparkSession) -> None:
    """Register the source with a session, as ``spark.readStream.format("oncekit-kafka")``."""
    from oncekit.core.spark.session import register_data_source
    from oncekit.sources._spark_kafka import KafkaDataSource

    register_data_source(spark, KafkaDataSource)

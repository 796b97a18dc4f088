"""Kafka sinks (confluent-kafka): transactional, write-ahead log, at-least-once.

A Kafka transaction can be committed only by the producer that opened it, and librdkafka cannot
resume another process's transaction, so no task can leave a transaction open for the driver.

- ``transactional``: each task writes through a producer whose ``transactional.id`` is stable
  per (sink, partition), so a zombie attempt is fenced, and commits at the end of the task. In
  the same transaction it records a batch marker with ``send_offsets_to_transaction``: group
  ``oncekit-<sink>-<partition>``, offset = batch id + 1, metadata = row count and checksum. A
  replayed batch finds its marker and writes nothing; a checksum that differs exposes a
  non-deterministic replay.
- ``write-ahead-log``: tasks stage rows under the checkpoint; once the checkpoint is complete,
  one transaction publishes them with the batch marker (group ``oncekit-<sink>``).
- ``at-least-once``: an idempotent producer, flushed at the end of each task.

The stream needs a ``value`` column (string or binary) and may have a ``key`` column.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from oncekit.connectors.base import redact_config
from oncekit.connectors.kafka import KafkaConfig, broker_settings, create_topic
from oncekit.core.base import CommitOutcome, Committable, DeliveryGuarantee, IdempotentSink, Sink, TaskInfo, WriteAheadSink
from oncekit.core.errors import ConfigError, OncekitError
from oncekit.core.staging import StagedFiles
from oncekit.sinks.base import SinkConfig

if TYPE_CHECKING:
    import pyarrow as pa

logger = logging.getLogger(__name__)

FORMAT = "oncekit-kafka-sink"
PROTOCOLS = ("transactional", "write-ahead-log", "at-least-once")
DEFAULT_TRANSACTION_TIMEOUT_MS = 60_000  # the broker's transaction.max.timeout.ms must allow it


class NonDeterministicReplayError(OncekitError):
    """A replayed batch would write other records than the committed attempt wrote."""


class RecordError(OncekitError):
    """A record could not be written; the message names sink, batch, partition and row."""


@dataclass(frozen=True)
class KafkaSinkConfig(SinkConfig):
    """A Kafka sink. ``client`` holds librdkafka settings (security, SASL); secrets never reach
    ``repr`` or error text. ``partitions`` is used when the topic must be created."""

    format_name: ClassVar[str] = FORMAT

    bootstrap_servers: str
    topic: str
    protocol: str = "transactional"
    sink_id: str = ""
    client: Mapping[str, str] = field(default_factory=dict)
    partitions: int = 2
    transaction_timeout_ms: int = DEFAULT_TRANSACTION_TIMEOUT_MS
    dead_letter_topic: str | None = None
    columns: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self._check_common(self.protocol, PROTOCOLS, self.topic, f"kafka-{self.topic}")
        if self.columns and "value" not in self.columns:
            raise ConfigError(f"{FORMAT} sink {self.sink_id}: the stream needs a value column; it has {', '.join(self.columns)}")

    def __repr__(self) -> str:
        return (f"KafkaSinkConfig(bootstrap_servers={self.bootstrap_servers!r}, topic={self.topic!r}, "
                f"protocol={self.protocol!r}, sink_id={self.sink_id!r}, client={redact_config(self.client)!r})")

    @property
    def kafka(self) -> KafkaConfig:
        return KafkaConfig(self.bootstrap_servers, dict(self.client))

    def to_options(self) -> dict[str, str]:
        options = {"kafka.bootstrap.servers": self.bootstrap_servers, "topic": self.topic, "protocol": self.protocol,
                   "sinkid": self.sink_id, "partitions": str(self.partitions),
                   "transactiontimeoutms": str(self.transaction_timeout_ms)}
        options.update({f"kafka.{k}": v for k, v in self.client.items()})
        if self.dead_letter_topic:
            options["deadlettertopic"] = self.dead_letter_topic
        return options

    @classmethod
    def from_options(cls, options: Mapping[str, str], columns: tuple[str, ...]) -> KafkaSinkConfig:
        lowered = {k.lower(): v for k, v in options.items()}
        client = {k[len("kafka."):]: v for k, v in lowered.items() if k.startswith("kafka.")}
        bootstrap = client.pop("bootstrap.servers", "")
        if not bootstrap:
            raise ConfigError(f"{FORMAT}: option kafka.bootstrap.servers is required")
        return cls(
            bootstrap_servers=bootstrap, topic=lowered.get("topic", ""), protocol=lowered.get("protocol", "transactional"),
            sink_id=lowered.get("sinkid", ""), client=client, partitions=int(lowered.get("partitions", "2")),
            transaction_timeout_ms=int(lowered.get("transactiontimeoutms", DEFAULT_TRANSACTION_TIMEOUT_MS)),
            dead_letter_topic=lowered.get("deadlettertopic") or None, columns=columns,
        )

    @property
    def guarantee(self) -> DeliveryGuarantee:
        return DeliveryGuarantee.AT_LEAST_ONCE if self.protocol == "at-least-once" else DeliveryGuarantee.EXACTLY_ONCE

    def build(self, checkpoint: str) -> Sink:
        if self.protocol == "transactional":
            return KafkaTransactionalSink(self)
        if self.protocol == "write-ahead-log":
            return KafkaWriteAheadSink(self, checkpoint)
        return KafkaAtLeastOnceSink(self)


def kafka_sink(bootstrap_servers: str, topic: str, protocol: str = "transactional", **options: Any) -> KafkaSinkConfig:
    """The typed builder: ``kafka_sink("broker:9092", "balances", "transactional")``."""
    return KafkaSinkConfig(bootstrap_servers=bootstrap_servers, topic=topic, protocol=protocol, **options)


@dataclass(frozen=True)
class _Records:
    """One partition's (or batch's) records, with what the marker records of them."""

    keys: list[bytes | None]
    values: list[bytes | None]

    @property
    def checksum(self) -> str:
        """Order-independent: a replay may deliver a partition's rows in another order."""
        total = 0
        for key, value in zip(self.keys, self.values):
            digest = hashlib.blake2b((key or b"") + b"\0" + (value or b""), digest_size=8).digest()
            total = (total + int.from_bytes(digest, "big")) % (1 << 64)
        return f"{total:016x}"

    @classmethod
    def from_batches(cls, batches: Iterator[pa.RecordBatch], where: str) -> _Records:
        keys: list[bytes | None] = []
        values: list[bytes | None] = []
        for batch in batches:
            names = batch.schema.names
            if "value" not in names:
                raise ConfigError(f"{where}: the stream needs a value column; it has {', '.join(names)}")
            values.extend(_as_bytes(batch.column(names.index("value")).to_pylist(), where, "value", len(values)))
            key_column = batch.column(names.index("key")).to_pylist() if "key" in names else [None] * batch.num_rows
            keys.extend(_as_bytes(key_column, where, "key", len(keys)))
        return cls(keys, values)


def _as_bytes(column: list[Any], where: str, name: str, first_row: int) -> list[bytes | None]:
    out: list[bytes | None] = []
    for index, value in enumerate(column):
        if value is None or isinstance(value, bytes):
            out.append(value)
        elif isinstance(value, str):
            out.append(value.encode())
        else:
            raise RecordError(f"{where}: row {first_row + index}, column {name}: cannot serialize "
                              f"{type(value).__name__}; give string or binary")
    return out


class _KafkaSink:
    """Producers, topics, markers and preflight shared by the three protocols."""

    config: KafkaSinkConfig
    sink_id: str

    def preflight(self) -> None:
        """Driver, at query start: the topic exists (or is created), and the transaction timeout
        fits under the broker's maximum."""
        kafka = self.config.kafka
        create_topic(kafka, self.config.topic, partitions=self.config.partitions)
        if self.config.dead_letter_topic:
            create_topic(kafka, self.config.dead_letter_topic, partitions=1)
        if self.config.protocol == "at-least-once":
            return
        maximum = int(broker_settings(kafka)["transaction.max.timeout.ms"])
        if self.config.transaction_timeout_ms > maximum:
            raise ConfigError(
                f"{FORMAT} sink {self.sink_id}: transaction_timeout_ms {self.config.transaction_timeout_ms} is above the "
                f"broker's transaction.max.timeout.ms {maximum}; lower it or raise the broker's maximum"
            )

    def producer(self, **extra: Any) -> Any:
        from confluent_kafka import Producer

        return Producer(self.config.kafka.settings(linger_ms=5, **extra))

    def transactional_producer(self, transactional_id: str) -> Any:
        """A producer whose init fences every earlier producer with the same id and aborts the
        transaction it left open."""
        producer = self.producer(transactional_id=transactional_id,
                                 transaction_timeout_ms=self.config.transaction_timeout_ms)
        producer.init_transactions(30)
        return producer

    def marker(self, group: str) -> tuple[int, dict[str, Any]]:
        """The committed batch marker of ``group``: (offset, metadata); a negative offset when none.
        read_committed makes the offset fetch stable: it waits for pending transactional commits."""
        from confluent_kafka import Consumer, TopicPartition

        consumer = Consumer(self.config.kafka.settings(group_id=group, enable_auto_commit=False,
                                                       isolation_level="read_committed"))
        try:
            (committed,) = consumer.committed([TopicPartition(self.config.topic, 0)], timeout=30)
        finally:
            consumer.close()
        metadata = json.loads(committed.metadata) if committed.metadata else {}
        return committed.offset, metadata

    def publish(self, producer: Any, records: _Records, group: str, batch_id: int, where: str) -> None:
        """Produce ``records`` and the batch marker in one transaction, and commit it."""
        from confluent_kafka import Consumer, KafkaException, TopicPartition

        errors: list[str] = []

        def delivered(error: Any, message: Any) -> None:
            if error is not None:
                errors.append(str(error))

        producer.begin_transaction()
        try:
            for index, (key, value) in enumerate(zip(records.keys, records.values)):
                self._produce(producer, key, value, delivered, where, index)
            producer.flush(self.config.transaction_timeout_ms / 1000)
            if errors:
                raise RecordError(f"{where}: {len(errors)} records were not delivered: {errors[0]}")
            consumer = Consumer(self.config.kafka.settings(group_id=group, enable_auto_commit=False))
            try:
                metadata = json.dumps({"batch": batch_id, "rows": len(records.values), "checksum": records.checksum})
                producer.send_offsets_to_transaction(
                    [TopicPartition(self.config.topic, 0, batch_id + 1, metadata)], consumer.consumer_group_metadata(), 30)
            finally:
                consumer.close()
            _commit_transaction(producer)
        except KafkaException as exc:
            error = exc.args[0]
            if not error.fatal():
                producer.abort_transaction(30)
            raise OncekitError(f"{where}: transaction failed: {error.str()}") from exc
        except BaseException:
            producer.abort_transaction(30)
            raise

    def _produce(self, producer: Any, key: bytes | None, value: bytes | None, delivered: Any, where: str, index: int) -> None:
        from confluent_kafka import KafkaError, KafkaException

        while True:
            try:
                producer.produce(self.config.topic, key=key, value=value, on_delivery=delivered)
                return
            except BufferError:  # the local queue is full: let deliveries drain it
                producer.poll(0.1)
            except KafkaException as exc:
                if exc.args[0].code() == KafkaError.MSG_SIZE_TOO_LARGE and self.config.dead_letter_topic:
                    producer.produce(self.config.dead_letter_topic, key=key, value=(value or b"")[:1024],
                                     headers={"oncekit.error": f"{where}: row {index}: too large"})
                    return
                raise RecordError(f"{where}: row {index}: {exc.args[0].str()}") from exc


def _commit_transaction(producer: Any) -> None:
    """Commit, retrying what the client marks retriable."""
    from confluent_kafka import KafkaException

    for attempt in range(5):
        try:
            producer.commit_transaction(60)
            return
        except KafkaException as exc:
            if not exc.args[0].retriable() or attempt == 4:
                raise
            time.sleep(0.5 * (attempt + 1))


class KafkaTransactionalSink(_KafkaSink, IdempotentSink):
    """Each task commits its own transaction with the batch marker; see the module docstring."""

    def __init__(self, config: KafkaSinkConfig) -> None:
        self.config, self.sink_id, self.guarantee = config, config.sink_id, config.guarantee

    def upsert(self, task: TaskInfo, batches: Iterator[pa.RecordBatch]) -> int:
        where = f"{FORMAT} sink {self.sink_id} batch {task.batch_id} partition {task.partition_id}"
        records = _Records.from_batches(batches, where)
        producer = self.transactional_producer(f"oncekit-{self.sink_id}-{task.partition_id}")
        group = f"oncekit-{self.sink_id}-{task.partition_id}"
        offset, metadata = self.marker(group)
        if offset > task.batch_id:
            if offset == task.batch_id + 1 and metadata.get("checksum") != records.checksum:
                raise NonDeterministicReplayError(
                    f"{where}: the batch is committed with {metadata.get('rows')} records (checksum "
                    f"{metadata.get('checksum')}), but its replay has {len(records.values)} (checksum {records.checksum}); "
                    "the pipeline is not deterministic, so exactly-once cannot hold"
                )
            logger.info("%s: already committed (marker %s); writing nothing", where, offset)
            return 0
        self.publish(producer, records, group, task.batch_id, where)
        logger.info("%s txn %s: committed %s records", where, f"oncekit-{self.sink_id}-{task.partition_id}",
                    len(records.values))
        return len(records.values)


class KafkaWriteAheadSink(_KafkaSink, WriteAheadSink):
    """Tasks stage; once the checkpoint is complete one transaction publishes the batch with its
    marker, so output is visible only after the checkpoint, as with Flink."""

    def __init__(self, config: KafkaSinkConfig, checkpoint: str) -> None:
        self.config, self.sink_id, self.guarantee = config, config.sink_id, config.guarantee
        self.staged = StagedFiles(checkpoint, config.sink_id)

    def send_values(self, batch_id: int, committables: Sequence[Committable], crash: Any = None) -> CommitOutcome:
        from confluent_kafka import KafkaException

        where = f"{FORMAT} sink {self.sink_id} batch {batch_id}"
        group = f"oncekit-{self.sink_id}"
        if self.marker(group)[0] > batch_id:
            return CommitOutcome.ALREADY_COMMITTED
        keys: list[bytes | None] = []
        values: list[bytes | None] = []
        for index, committable in enumerate(committables):
            if index and crash is not None:
                crash("mid_commit", batch_id)
            part = _Records.from_batches(self.staged.read(committable), f"{where} partition {committable.partition_id}")
            keys.extend(part.keys)
            values.extend(part.values)
        try:
            producer = self.transactional_producer(f"oncekit-{self.sink_id}-publisher")
            if self.marker(group)[0] > batch_id:  # published while this producer was starting
                return CommitOutcome.ALREADY_COMMITTED
            self.publish(producer, _Records(keys, values), group, batch_id, where)
        except (KafkaException, OncekitError):
            # Two notifications for one batch fence each other; the one that wins publishes it.
            if self._wait_for_marker(group, batch_id):
                return CommitOutcome.ALREADY_COMMITTED
            raise
        return CommitOutcome.COMMITTED

    def _wait_for_marker(self, group: str, batch_id: int, timeout_s: float = 60.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.marker(group)[0] > batch_id:
                return True
            time.sleep(1.0)
        return False


class KafkaAtLeastOnceSink(_KafkaSink, Sink):
    """An idempotent producer flushed at the end of each task; delivery errors fail the task."""

    protocol = "at-least-once"

    def __init__(self, config: KafkaSinkConfig) -> None:
        self.config, self.sink_id, self.guarantee = config, config.sink_id, config.guarantee

    def write_partition(self, task: TaskInfo, batches: Iterator[pa.RecordBatch]) -> Committable | None:
        where = f"{FORMAT} sink {self.sink_id} batch {task.batch_id} partition {task.partition_id}"
        records = _Records.from_batches(batches, where)
        producer = self.producer(enable_idempotence=True)
        errors: list[str] = []

        def delivered(error: Any, message: Any) -> None:
            if error is not None:
                errors.append(str(error))

        for index, (key, value) in enumerate(zip(records.keys, records.values)):
            self._produce(producer, key, value, delivered, where, index)
        remaining = producer.flush(60)
        if errors or remaining:
            raise RecordError(f"{where}: {len(errors) + remaining} records were not delivered: {(errors or ['timeout'])[0]}")
        return None


__all__ = ["KafkaSinkConfig", "NonDeterministicReplayError", "RecordError", "kafka_sink"]

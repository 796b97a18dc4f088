"""What the Kafka sinks' protocols share: the records of a partition or batch with their
checksum, producers, the batch marker, publishing in one transaction, and the preflight.

The batch marker is a consumer group's committed offset on partition 0 of the output topic,
written with ``send_offsets_to_transaction`` inside the transaction that publishes the batch:
offset = batch id + 1, metadata = batch, row count and checksum. Its group is a
:class:`~oncekit.core.names.MarkerGroup`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition

from oncekit.connectors.kafka import broker_settings, create_topic
from oncekit.core.errors import ConfigError, OncekitError, RecordError
from oncekit.core.names import KafkaTransactionalId, MarkerGroup

if TYPE_CHECKING:
    from oncekit.sinks.kafka.config import KafkaSinkConfig

logger = logging.getLogger(__name__)

FORMAT = "oncekit-kafka-sink"
DEFAULT_TRANSACTION_TIMEOUT_MS = 60_000  # the broker's transaction.max.timeout.ms must allow it


@dataclass(frozen=True)
class Records:
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
    def from_batches(cls, batches: Iterator[pa.RecordBatch], where: str) -> Records:
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


class KafkaSinkBase:
    """Producers, topics, markers and preflight shared by the three protocols. Built by
    ``KafkaSinkConfig.build`` in the driver's worker, a task, or the listener."""

    def __init__(self, config: KafkaSinkConfig) -> None:
        self.config, self.sink_id = config, config.sink_id

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config!r})"

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

    def producer(self, **extra: Any) -> Producer:
        return Producer(self.config.kafka.settings(linger_ms=5, **extra))

    def transactional_producer(self, transactional_id: KafkaTransactionalId) -> Producer:
        """A producer whose init fences every earlier producer with the same id and aborts the
        transaction it left open."""
        producer = self.producer(transactional_id=str(transactional_id),
                                 transaction_timeout_ms=self.config.transaction_timeout_ms)
        producer.init_transactions(30)
        return producer

    def marker(self, group: MarkerGroup) -> tuple[int, dict[str, Any]]:
        """The committed batch marker of ``group``: (offset, metadata); a negative offset when none.
        read_committed makes the offset fetch stable: it waits for pending transactional commits."""
        consumer = Consumer(self.config.kafka.settings(group_id=str(group), enable_auto_commit=False,
                                                       isolation_level="read_committed"))
        try:
            (committed,) = consumer.committed([TopicPartition(self.config.topic, 0)], timeout=30)
        finally:
            consumer.close()
        metadata = json.loads(committed.metadata) if committed.metadata else {}
        return committed.offset, metadata

    def publish(self, producer: Producer, records: Records, group: MarkerGroup, batch_id: int, where: str) -> None:
        """Produce ``records`` and the batch marker in one transaction, and commit it."""
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
            consumer = Consumer(self.config.kafka.settings(group_id=str(group), enable_auto_commit=False))
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

    def _produce(self, producer: Producer, key: bytes | None, value: bytes | None, delivered: Any, where: str, index: int) -> None:
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


def _commit_transaction(producer: Producer) -> None:
    """Commit, retrying what the client marks retriable."""
    for attempt in range(5):
        try:
            producer.commit_transaction(60)
            return
        except KafkaException as exc:
            if not exc.args[0].retriable() or attempt == 4:
                raise
            time.sleep(0.5 * (attempt + 1))

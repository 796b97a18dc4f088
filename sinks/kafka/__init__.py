"""Kafka sinks (confluent-kafka), one module per protocol: ``transactional``, ``write_ahead_log``,
``at_least_once``; ``config`` holds :func:`kafka_sink`.

A Kafka transaction can be committed only by the producer that opened it, and librdkafka cannot
resume another process's transaction, so no task can leave a transaction open for the driver:
the transactional sink commits per task with a batch marker, the write-ahead log publishes after
the checkpoint. The stream needs a ``value`` column (string or binary) and may have a ``key``.
"""

from __future__ import annotations

from oncekit.core.errors import NonDeterministicReplayError, RecordError
from oncekit.sinks.kafka._common import DEFAULT_TRANSACTION_TIMEOUT_MS
from oncekit.sinks.kafka.at_least_once import KafkaAtLeastOnceSink
from oncekit.sinks.kafka.config import PROTOCOLS, KafkaSinkConfig, kafka_sink
from oncekit.sinks.kafka.transactional import KafkaTransactionalSink
from oncekit.sinks.kafka.write_ahead_log import KafkaWriteAheadSink

__all__ = [
    "DEFAULT_TRANSACTION_TIMEOUT_MS",
    "PROTOCOLS",
    "KafkaAtLeastOnceSink",
    "KafkaSinkConfig",
    "KafkaTransactionalSink",
    "KafkaWriteAheadSink",
    "NonDeterministicReplayError",
    "RecordError",
    "kafka_sink",
]

"""The Kafka sinks' marker topic on a real broker: created compacted, grown as Spark's partitions
are, refused when its records could expire, and carried over from the consumer-group offsets the
kit used before; a resumed checkpoint without any markers is refused."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic  # type: ignore[attr-defined]

from oncekit.connectors import KafkaConfig
from oncekit.connectors.kafka_admin import create_topic
from oncekit.core.errors import ConfigError
from oncekit.core.names import MarkerTopic
from oncekit.core.protocol import SinkOwner
from oncekit.sinks.kafka import KafkaTransactionalSink, kafka_sink
from oncekit.sinks.kafka._batch_marker import BatchMarker

pytestmark = pytest.mark.services


def new_sink(kafka: KafkaConfig, tmp_path: Path) -> KafkaTransactionalSink:
    topic = f"markers-{uuid.uuid4().hex[:8]}"
    sink = kafka_sink(kafka.bootstrap_servers, topic, "transactional").build(str(tmp_path))
    assert isinstance(sink, KafkaTransactionalSink)
    return sink


def test_marker_topic_is_compacted_and_grows_with_spark_partitions(kafka: KafkaConfig, tmp_path: Path) -> None:
    sink = new_sink(kafka, tmp_path)
    sink.preflight()
    admin = AdminClient(kafka.settings())
    resource = ConfigResource(ConfigResource.Type.TOPIC, sink.markers.topic)
    assert admin.describe_configs([resource])[resource].result(timeout=30)["cleanup.policy"].value == "compact"
    assert sink.markers.latest(0, "test") is None
    sink.markers.ensure_writer(5)
    assert len(admin.list_topics(sink.markers.topic, timeout=10).topics[sink.markers.topic].partitions) == 7
    producer = Producer(kafka.settings(transactional_id=f"test-{uuid.uuid4()}"))
    producer.init_transactions(30)
    producer.begin_transaction()
    sink.markers.produce(producer, 5, BatchMarker(3, 10, "a-1"))
    producer.commit_transaction(30)
    assert sink.markers.latest(5, "test", settle_s=30) == BatchMarker(3, 10, "a-1")
    owner = SinkOwner("query", str(tmp_path))
    sink.record_owner(owner)
    assert sink.recorded_owner() == owner


def test_marker_topic_that_deletes_records_is_refused(kafka: KafkaConfig, tmp_path: Path) -> None:
    sink = new_sink(kafka, tmp_path)
    admin = AdminClient(kafka.settings())  # must outlive the future
    admin.create_topics([NewTopic(sink.markers.topic, 2, config={"cleanup.policy": "delete"})])[
        sink.markers.topic].result(timeout=30)
    with pytest.raises(ConfigError, match=r"cleanup.policy=delete.*--add-config cleanup.policy=compact"):
        sink.preflight()


def test_resumed_checkpoint_without_any_markers_is_refused(kafka: KafkaConfig, tmp_path: Path) -> None:
    sink = new_sink(kafka, tmp_path)
    with pytest.raises(ConfigError, match=rf"{sink.sink_id}: this checkpoint has written through the sink before"):
        sink.preflight(resumed=True)


def test_markers_kept_in_consumer_groups_are_carried_over(kafka: KafkaConfig, tmp_path: Path) -> None:
    """What the kit wrote before its marker topic: ``oncekit-<sink>-<partition>`` groups' committed
    offsets on partition 0 of the output topic (offset = batch + 1, metadata = rows and
    checksum), and the owner in ``oncekit-<sink>:owner``."""
    sink = new_sink(kafka, tmp_path)
    create_topic(kafka, sink.config.topic, partitions=2)
    legacy = {f"oncekit-{sink.sink_id}-0": (8, json.dumps({"batch": 7, "rows": 4, "checksum": "4-x"})),
              f"oncekit-{sink.sink_id}-1": (9, json.dumps({"batch": 8, "rows": 0, "checksum": "0-y"})),
              f"oncekit-{sink.sink_id}:owner": (0, json.dumps({"query_id": "q", "checkpoint": "/c"}))}
    for group, (offset, metadata) in legacy.items():
        consumer = Consumer(kafka.settings(group_id=group, enable_auto_commit=False))
        consumer.commit(offsets=[TopicPartition(sink.config.topic, 0, offset, metadata)], asynchronous=False)
        consumer.close()
    sink.preflight(resumed=True)
    assert sink.markers.latest(0, "test", settle_s=30) == BatchMarker(7, 4, "4-x")
    assert sink.markers.latest(1, "test", settle_s=30) == BatchMarker(8, 0, "0-y")
    assert sink.recorded_owner() == SinkOwner("q", "/c")
    assert str(MarkerTopic(sink.sink_id)) == sink.markers.topic


def test_marker_waits_for_room_when_the_records_filled_the_producers_queue(kafka: KafkaConfig, tmp_path: Path) -> None:
    """A task's records can fill librdkafka's local queue (1,000,000 messages in the sinks'
    producers): the batch marker after them waits for deliveries to make room. make bench's
    fan-out group found it failing instead: every task of 1,000,000 records raised BufferError
    at its marker, in every retry, so the batch could never commit and the query stopped."""
    sink = new_sink(kafka, tmp_path)
    sink.preflight()
    sink.markers.ensure_writer(0)
    create_topic(kafka, sink.config.topic, partitions=1)
    producer = Producer(kafka.settings(transactional_id=f"test-{uuid.uuid4()}", queue_buffering_max_messages=10,
                                       linger_ms=200))
    producer.init_transactions(30)
    producer.begin_transaction()
    for i in range(10):  # the queue is full, and lingers 200 ms before it sends
        producer.produce(sink.config.topic, b"record", str(i).encode())
    sink.markers.produce(producer, 0, BatchMarker(1, 10, "10-x"))
    producer.commit_transaction(30)
    assert sink.markers.latest(0, "test", settle_s=30) == BatchMarker(1, 10, "10-x")

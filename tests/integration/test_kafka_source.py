"""The Kafka source on a real broker: read_committed, transaction markers, replay from checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from oncekit.connectors import KafkaConfig
from tests.integration.test_services import produce_transactions

pytestmark = [pytest.mark.services, pytest.mark.spark]


def test_kafka_source_batch_reads_each_committed_record_once(spark: Any, kafka: KafkaConfig, topic: str) -> None:
    committed = [f"c{i}".encode() for i in range(200)]
    produce_transactions(kafka, topic, committed, [f"a{i}".encode() for i in range(100)])
    rows = (
        spark.read.format("oncekit-kafka")
        .option("kafka.bootstrap.servers", kafka.bootstrap_servers)
        .option("subscribe", topic)
        .load()
        .select("value")
        .collect()
    )
    # The topic ends in a commit marker and an abort marker: the read must still end.
    assert sorted(r.value for r in rows) == sorted(committed)


def test_kafka_source_stream_available_now_reads_all_in_capped_batches(
    spark: Any, kafka: KafkaConfig, topic: str, tmp_path: Path
) -> None:
    committed = [f"c{i}".encode() for i in range(300)]
    produce_transactions(kafka, topic, committed, [b"aborted"])
    query = (
        spark.readStream.format("oncekit-kafka")
        .option("kafka.bootstrap.servers", kafka.bootstrap_servers)
        .option("subscribe", topic)
        .option("maxOffsetsPerTrigger", "100")
        .load()
        .writeStream.format("memory")
        .queryName(topic.replace("-", "_"))
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    assert len(query.recentProgress) >= 3
    values = [r.value for r in spark.sql(f"SELECT value FROM {topic.replace('-', '_')}").collect()]
    assert sorted(values) == sorted(committed)


def test_kafka_source_deleted_range_fails_with_data_loss_error_or_skips(spark: Any, kafka: KafkaConfig, topic: str) -> None:
    from confluent_kafka import Producer, TopicPartition
    from confluent_kafka.admin import AdminClient

    producer = Producer(kafka.settings())
    for i in range(100):
        producer.produce(topic, value=f"c{i}".encode(), partition=0)
    producer.flush(30)
    admin = AdminClient(kafka.settings())
    deleted = admin.delete_records([TopicPartition(topic, 0, 30)])  # retention took offsets 0..29
    for future in deleted.values():
        future.result(timeout=30)

    def read(fail_on_data_loss: str) -> list[Any]:
        return (
            spark.read.format("oncekit-kafka")
            .option("kafka.bootstrap.servers", kafka.bootstrap_servers)
            .option("subscribe", topic)
            .option("startingOffsets", f'{{"{topic}": {{"0": 0, "1": 0}}}}')
            .option("failOnDataLoss", fail_on_data_loss)
            .load()
            .collect()
        )

    with pytest.raises(Exception, match=rf"topic {topic} partition 0: offsets 0..29 are gone"):
        read("true")
    rows = read("false")
    assert all(not (r.partition == 0 and r.offset < 30) for r in rows) and rows


def test_kafka_source_pattern_and_starting_timestamp(spark: Any, kafka: KafkaConfig, topic: str) -> None:
    from confluent_kafka import Producer

    producer = Producer(kafka.settings())
    for i in range(10):
        producer.produce(topic, value=f"v{i}".encode(), partition=0, timestamp=1_000_000 + i * 1000)
    producer.flush(30)
    rows = (
        spark.read.format("oncekit-kafka")
        .option("kafka.bootstrap.servers", kafka.bootstrap_servers)
        .option("subscribePattern", topic.replace("-", "[-]"))
        .option("startingTimestamp", str(1_000_000 + 6 * 1000))
        .load()
        .selectExpr("value", "unix_millis(timestamp) AS ms", "timestampType")
        .collect()
    )
    # each message's own timestamp and type (0: CreateTime), as Spark's source gives them
    assert sorted((r.value, r.ms, r.timestampType) for r in rows) == [
        (f"v{i}".encode(), 1_000_000 + i * 1000, 0) for i in range(6, 10)]


def test_kafka_source_picks_up_new_partitions_and_mirrors_offsets_to_group(
    spark: Any, kafka: KafkaConfig, unique_name: str, tmp_path: Path
) -> None:
    from confluent_kafka import Consumer, Producer, TopicPartition
    from confluent_kafka.admin import AdminClient, NewPartitions  # type: ignore[attr-defined]

    from oncekit.connectors.kafka_admin import create_topic

    topic, group = unique_name.replace("_", "-"), f"lag-{unique_name}"
    create_topic(kafka, topic, partitions=1)
    producer = Producer(kafka.settings())
    seen: list[bytes] = []

    def run() -> None:
        (spark.readStream.format("oncekit-kafka").option("kafka.bootstrap.servers", kafka.bootstrap_servers)
         .option("subscribe", topic).option("consumerGroup", group).option("maxOffsetsPerTrigger", "10").load()
         .writeStream.foreachBatch(lambda frame, _: seen.extend(r.value for r in frame.select("value").collect()))
         .option("checkpointLocation", str(tmp_path / "checkpoint")).trigger(availableNow=True).start()
         .awaitTermination())

    for i in range(20):
        producer.produce(topic, value=f"p0-{i}".encode(), partition=0)
    producer.flush(30)
    run()
    admin = AdminClient(kafka.settings())
    for future in admin.create_partitions([NewPartitions(topic, 2)]).values():
        future.result(timeout=30)
    producer = Producer(kafka.settings())  # a fresh client knows the new partition
    for i in range(5):
        producer.produce(topic, value=f"p1-{i}".encode(), partition=1)
    producer.flush(30)
    run()

    assert sorted(seen) == sorted([f"p0-{i}".encode() for i in range(20)] + [f"p1-{i}".encode() for i in range(5)])
    consumer = Consumer(kafka.settings(group_id=group))
    (mirrored,) = consumer.committed([TopicPartition(topic, 0)], timeout=30)
    consumer.close()
    assert mirrored.offset >= 10  # ends of completed batches, for lag monitoring

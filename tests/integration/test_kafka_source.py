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

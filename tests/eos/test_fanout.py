"""One checkpoint, many sinks: one query writes every input record to PostgreSQL (two-phase
commit) and to Kafka (transactional), crashes once at a named point, restarts from the same
checkpoint, and each target holds the input exactly once (multiset equality per target)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg
import pytest

from oncekit.connectors import KafkaConfig
from oncekit.connectors.kafka_admin import create_topic
from oncekit.core.crash import POINTS, arm, fired
from oncekit.core.errors import ConfigError
from oncekit.core.fanout import fan_out
from oncekit.sinks.kafka import kafka_sink
from oncekit.sinks.postgres import postgres_sink
from oncekit.verify import compare
from tests.eos.pipeline import COUNT, PER_BATCH, integers, prepared_transactions, produce_input, read_committed, run_available_now, table_ids

pytestmark = [pytest.mark.services, pytest.mark.spark]


def both_targets(frame: Any) -> Any:
    """Every record twice: once routed to the table, once to the topic."""
    return frame.selectExpr("id", "payload", "CAST(id AS STRING) AS key", "CAST(id AS STRING) AS value",
                            "explode(array('table', 'topic')) AS target")


def sinks(kafka: KafkaConfig, dsn: str, table: str, topic: str) -> Any:
    return fan_out({
        "table": postgres_sink(dsn, table, "two-phase-commit", columns=("id", "payload")),
        "topic": kafka_sink(kafka.bootstrap_servers, topic, "transactional", columns=("key", "value")),
    })


@pytest.mark.parametrize("point", POINTS)
def test_fanout_crash_once_then_restart_is_exactly_once_in_every_target(
    spark: Any, kafka: KafkaConfig, postgres_dsn: str, topic: str, unique_name: str, tmp_path: Path,
    crash_dir: Path, point: str,
) -> None:
    expected = produce_input(kafka, topic, COUNT)
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {unique_name} (id int NOT NULL, payload text NOT NULL)")
    out = f"{topic}-out"
    create_topic(kafka, out, partitions=2)
    sink = sinks(kafka, postgres_dsn, unique_name, out)
    checkpoint = str(tmp_path / "checkpoint")
    arm(crash_dir, point, batch_id=1)

    with pytest.raises(Exception):
        run_available_now(both_targets(integers(spark, kafka, topic, PER_BATCH)), sink, checkpoint)
    assert fired(crash_dir) == [point]
    run_available_now(both_targets(integers(spark, kafka, topic, PER_BATCH)), sink, checkpoint)

    in_table = compare(expected, table_ids(postgres_dsn, unique_name))
    assert in_table.exactly_once, in_table.summary()
    in_topic = compare(expected, [int(v) for v in read_committed(kafka, out, COUNT, timeout_s=60)])
    assert in_topic.exactly_once, in_topic.summary()
    assert prepared_transactions(postgres_dsn, unique_name) == []


def test_fanout_row_for_unknown_target_fails_naming_route_batch_and_partition(
    spark: Any, kafka: KafkaConfig, postgres_dsn: str, topic: str, unique_name: str, tmp_path: Path,
) -> None:
    produce_input(kafka, topic, 100)
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {unique_name} (id int NOT NULL, payload text NOT NULL)")
    sink = sinks(kafka, postgres_dsn, unique_name, f"{topic}-out")
    frame = integers(spark, kafka, topic, PER_BATCH).selectExpr(
        "id", "payload", "CAST(id AS STRING) AS key", "CAST(id AS STRING) AS value", "'elsewhere' AS target")
    with pytest.raises(Exception, match=rf"sink {sink.sink_id} batch 0 partition \d: rows routed to \['elsewhere'\]"):
        run_available_now(frame, sink, str(tmp_path / "checkpoint"))
    assert table_ids(postgres_dsn, unique_name) == []


def test_fanout_config_refuses_two_targets_with_one_sink_id(kafka: KafkaConfig) -> None:
    with pytest.raises(ConfigError, match="target sink ids must differ"):
        fan_out({"a": kafka_sink(kafka.bootstrap_servers, "t", sink_id="same"),
                 "b": kafka_sink(kafka.bootstrap_servers, "u", sink_id="same")})

"""Every Python example of the documentation site (``docs/examples/``, which the pages include)
but the quickstart (test_walkthrough.py runs it with ``oncekit run``, as its page does) runs as
its page says, against the real services and a real Spark session, and writes each
payment exactly once: the table's event ids (and the fan-out's topic) equal the input's, as
multisets."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest
from confluent_kafka import Producer

from oncekit.connectors import KafkaConfig
from oncekit.connectors.kafka_admin import create_topic
from oncekit.reference.generator import Workload, events
from oncekit.verify import compare, read_committed

pytestmark = [pytest.mark.services, pytest.mark.spark]

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"
PAYMENTS = 300


def produce_payments(kafka: KafkaConfig, topic: str, seed: int = 3) -> list[str]:
    """PAYMENTS events as ``oncekit produce`` sends them, one in twenty malformed (a bad JSON, an
    event without account or amount, an amount that is not a number); returns the ids of the
    well-formed ones, each sent once (ids differ from one ``seed`` to another)."""
    create_topic(kafka, topic, partitions=2)
    producer = Producer(kafka.settings())
    sent = list(events(Workload(count=PAYMENTS, duplicates=0, malformed=0.05, seed=seed)))
    assert sum(not event.unique for event in sent) >= 5
    for event in sent:
        producer.produce(topic, key=event.key, value=event.value)
    producer.flush(30)
    return [json.loads(event.value)["event_id"] for event in sent if event.unique]


def load(example: str, env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Any:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    spec = importlib.util.spec_from_file_location(f"docs_example_{example}", EXAMPLES / f"{example}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def table_ids(dsn: str, table: str) -> list[str]:
    with psycopg.connect(dsn) as conn:
        return [row[0] for row in conn.execute(f"SELECT event_id FROM {table}")]


@pytest.mark.parametrize("example", ["upsert", "standby", "fan_out"])  # quickstart: test_walkthrough.py
def test_documented_example_writes_every_payment_exactly_once(
        example: str, spark: Any, kafka: KafkaConfig, postgres_dsn: str, unique_name: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    topic, updates = unique_name.replace("_", "-"), f"{unique_name.replace('_', '-')}-updates"
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {unique_name} (event_id text, account_id int, amount_cents bigint)")
        if example == "upsert":  # its key: the page says the table needs a unique index on it
            conn.execute(f"CREATE UNIQUE INDEX ON {unique_name} (event_id)")
    expected = produce_payments(kafka, topic)
    module = load(example, {"ONCEKIT_KAFKA_BOOTSTRAP": kafka.bootstrap_servers, "ONCEKIT_POSTGRES_DSN": postgres_dsn,
                            "CHECKPOINTS": str(tmp_path), "TOPIC": topic, "TABLE": unique_name,
                            "UPDATES_TOPIC": updates}, monkeypatch)
    query = module.start(spark)
    try:
        deadline = time.monotonic() + 120
        while len(table_ids(postgres_dsn, unique_name)) < len(expected) and time.monotonic() < deadline:
            assert query.exception() is None, query.exception()
            time.sleep(0.5)
    finally:
        query.stop()
    verdict = compare(expected, table_ids(postgres_dsn, unique_name))
    assert verdict.exactly_once, verdict.summary()
    if example == "fan_out":
        sent = [json.loads(value)["event_id"] for value in read_committed(kafka, updates, len(expected))]
        verdict = compare(expected, sent)
        assert verdict.exactly_once, verdict.summary()

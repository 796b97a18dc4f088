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


def payment_events(seed: int = 3) -> list[Any]:
    """What :func:`produce_payments` sends for ``seed``, in order."""
    return list(events(Workload(count=PAYMENTS, duplicates=0, malformed=0.05, seed=seed)))


def produce_payments(kafka: KafkaConfig, topic: str, seed: int = 3) -> list[str]:
    """PAYMENTS events as ``oncekit produce`` sends them, one in twenty malformed (a bad JSON, an
    event without account or amount, an amount that is not a number); returns the ids of the
    well-formed ones, each sent once (ids differ from one ``seed`` to another)."""
    create_topic(kafka, topic, partitions=2)
    producer = Producer(kafka.settings())
    sent = payment_events(seed)
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


def exactly_once_in_table(query: Any, expected: list[str], dsn: str, table: str) -> None:
    """Wait (up to 120 s) until ``table`` holds as many rows as ``expected``, stop ``query``, and
    check the table's event ids equal ``expected`` as multisets."""
    try:
        deadline = time.monotonic() + 120
        while len(table_ids(dsn, table)) < len(expected) and time.monotonic() < deadline:
            assert query.exception() is None, query.exception()
            time.sleep(0.5)
    finally:
        query.stop()
    verdict = compare(expected, table_ids(dsn, table))
    assert verdict.exactly_once, verdict.summary()


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
    exactly_once_in_table(query, expected, postgres_dsn, unique_name)
    if example == "fan_out":
        sent = [json.loads(value)["event_id"] for value in read_committed(kafka, updates, len(expected))]
        verdict = compare(expected, sent)
        assert verdict.exactly_once, verdict.summary()


def test_the_readmes_job_writes_every_record_with_an_event_id_exactly_once(
        spark: Any, kafka: KafkaConfig, postgres_dsn: str, unique_name: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's job, its code as the README shows it but for the addresses, topic, table and
    checkpoint (each replaced where the README writes it, once): every input record whose JSON
    has an event id is in the table once, the malformed ones too (their amount NULL, as its
    comment says), and a record that is no JSON is left out."""
    readme = (EXAMPLES.parents[1] / "README.md").read_text()
    code = readme.split("```python\n", 1)[1].split("```", 1)[0]
    topic = unique_name.replace("_", "-")
    for written, here in [('"kafka:9092", "payments"', f'"{kafka.bootstrap_servers}", "{topic}"'),
                          ('os.environ["PAYMENTS_DSN"], "payments"', f'{postgres_dsn!r}, "{unique_name}"'),
                          ('"s3a://bucket/checkpoints/payments"', repr(str(tmp_path / "payments")))]:
        assert code.count(written) == 1, f"the README's job no longer writes {written}"
        code = code.replace(written, here)
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {unique_name} (event_id text, amount_cents bigint)")
    produce_payments(kafka, topic)
    expected = []
    for event in payment_events():
        try:
            expected.append(str(json.loads(event.value)["event_id"]))
        except (ValueError, KeyError):
            continue  # no JSON: get_json_object gives NULL, and the job filters it out
    module: dict[str, Any] = {}
    exec(compile(code, "README.md", "exec"), module)  # noqa: S102 - the README's own code
    query = module["start"](spark)
    exactly_once_in_table(query, expected, postgres_dsn, unique_name)

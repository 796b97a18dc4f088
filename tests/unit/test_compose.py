"""Static checks of docker/docker-compose.yml: it parses and carries the settings oncekit needs."""

from __future__ import annotations

from pathlib import Path

import yaml

from oncekit.connectors.kafka_broker import KAFKA_VERSION

COMPOSE = Path(__file__).resolve().parents[2] / "docker" / "docker-compose.yml"


def test_compose_kafka_has_single_broker_transaction_settings() -> None:
    kafka = yaml.safe_load(COMPOSE.read_text())["services"]["kafka"]
    env = kafka["environment"]
    assert kafka["image"] == f"apache/kafka:{KAFKA_VERSION}"
    assert env["KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR"] == "1"
    assert env["KAFKA_TRANSACTION_STATE_LOG_MIN_ISR"] == "1"
    assert env["KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR"] == "1"
    assert "broker" in env["KAFKA_PROCESS_ROLES"] and "controller" in env["KAFKA_PROCESS_ROLES"]


def test_compose_postgres_allows_prepared_transactions() -> None:
    postgres = yaml.safe_load(COMPOSE.read_text())["services"]["postgres"]
    command = postgres["command"]
    settings = [command[i + 1] for i, arg in enumerate(command) if arg == "-c"]
    (value,) = [s.split("=")[1] for s in settings if s.startswith("max_prepared_transactions=")]
    assert int(value) > 0


def test_pom_pins_the_same_kafka_release() -> None:
    pom = (COMPOSE.parent / "kafka" / "pom.xml").read_text()
    assert f"<kafka.version>{KAFKA_VERSION}</kafka.version>" in pom


def test_compose_pipeline_builds_the_package_and_reaches_the_services_inside_the_network() -> None:
    compose = yaml.safe_load(COMPOSE.read_text())
    pipeline = compose["services"]["pipeline"]
    dockerfile = (COMPOSE.parent / pipeline["build"]["context"] / pipeline["build"]["dockerfile"]).resolve()
    text = dockerfile.read_text()
    assert "pip install" in text and "openjdk-17" in text and 'ENTRYPOINT ["oncekit"]' in text
    assert set(pipeline["depends_on"]) == {"kafka", "postgres"}
    env = pipeline["environment"]
    kafka_env = compose["services"]["kafka"]["environment"]
    host, port = env["ONCEKIT_KAFKA_BOOTSTRAP"].split(":")
    assert f"INTERNAL://{host}:{port}" in kafka_env["KAFKA_ADVERTISED_LISTENERS"]
    assert f":{port}" in kafka_env["KAFKA_LISTENERS"] and "INTERNAL:PLAINTEXT" in kafka_env["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"]
    assert "@postgres:5432/" in env["ONCEKIT_POSTGRES_DSN"]
    assert pipeline["command"][:2] == ["pipeline", "run"]
    assert any(v.endswith(":/data") for v in pipeline["volumes"])

"""The services are real: Kafka transactions, read_committed, prepared transactions, restarts."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import psycopg
import pytest
from confluent_kafka import Producer

from oncekit.connectors import KafkaConfig, Services, start_services
from oncekit.connectors.kafka_admin import create_topic
from tests.eos.pipeline import read_committed

pytestmark = pytest.mark.services


def produce_transactions(kafka: KafkaConfig, topic: str, committed: list[bytes], aborted: list[bytes]) -> None:
    producer = Producer(kafka.settings(transactional_id=f"test-{topic}"))
    producer.init_transactions(30)
    producer.begin_transaction()
    for value in committed:
        producer.produce(topic, value=value)
    producer.commit_transaction(30)
    producer.begin_transaction()
    for value in aborted:
        producer.produce(topic, value=value)
    producer.flush(30)
    producer.abort_transaction(30)


def test_kafka_transactions_read_committed_sees_only_committed(kafka: KafkaConfig, topic: str) -> None:
    committed = [f"c{i}".encode() for i in range(50)]
    produce_transactions(kafka, topic, committed, [f"a{i}".encode() for i in range(50)])
    assert sorted(read_committed(kafka, topic, len(committed))) == sorted(committed)


def test_postgres_prepared_transaction_survives_connection_and_commits_elsewhere(
    postgres_dsn: str, unique_name: str
) -> None:
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {unique_name} (v int)")
    gid = f"oncekit-test:{unique_name}"
    conn = psycopg.connect(postgres_dsn)
    conn.execute(f"INSERT INTO {unique_name} VALUES (1), (2)")
    conn.execute(f"PREPARE TRANSACTION '{gid}'")
    conn.close()
    with psycopg.connect(postgres_dsn, autocommit=True) as other:
        assert other.execute("SELECT count(*) FROM pg_prepared_xacts WHERE gid = %s", (gid,)).fetchone() == (1,)
        assert other.execute(f"SELECT count(*) FROM {unique_name}").fetchone() == (0,)
        other.execute(f"COMMIT PREPARED '{gid}'")
        assert other.execute(f"SELECT v FROM {unique_name} ORDER BY v").fetchall() == [(1,), (2,)]
        assert other.execute("SELECT count(*) FROM pg_prepared_xacts WHERE gid = %s", (gid,)).fetchone() == (0,)


def test_kafka_restart_keeps_committed_transaction(services: Services, kafka: KafkaConfig, topic: str) -> None:
    committed = [f"before-restart-{i}".encode() for i in range(20)]
    produce_transactions(kafka, topic, committed, [b"aborted"])
    services.kafka.restart()
    assert sorted(read_committed(kafka, topic, len(committed))) == sorted(committed)


def test_postgres_network_cut_refuses_then_reconnect_serves(services: Services, postgres_dsn: str) -> None:
    services.postgres.disconnect()
    try:
        with pytest.raises(psycopg.OperationalError):
            psycopg.connect(postgres_dsn, connect_timeout=3).close()
    finally:
        services.postgres.reconnect()
    services.postgres.wait_ready(60)
    with psycopg.connect(postgres_dsn) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)


def test_local_backend_runs_real_kafka_and_postgres() -> None:
    """The local-process backend (no container engine): the same checks in miniature."""
    local = start_services("local")
    with local.running():
        kafka = KafkaConfig(local.kafka.bootstrap_servers)
        create_topic(kafka, "local-smoke", partitions=1)
        produce_transactions(kafka, "local-smoke", [b"kept"], [b"dropped"])
        assert read_committed(kafka, "local-smoke", 1) == [b"kept"]
        with psycopg.connect(local.postgres.dsn, autocommit=True) as conn:
            value = conn.execute("SHOW max_prepared_transactions").fetchone()
            assert value is not None and int(value[0]) > 0


def test_cli_services_up_status_down_as_the_pages_show_them(tmp_path: Any) -> None:
    """The getting-started page's ``services up --show-dsn`` (the default backend: containers
    where an engine answers) prints a DSN to export; the deployment page's block starts local
    processes, hides the password, reports them ready and stops them."""
    import os
    import subprocess
    import sys

    from tests.docs.console import console_commands

    env = {**os.environ, "ONCEKIT_STATE_DIR": str(tmp_path), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}

    def sh(command: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["bash", "-c", command], env=env, capture_output=True, text=True, timeout=300, check=False)

    (show,) = console_commands("services-up")
    up, status, down = console_commands("deploy-services")
    shown = sh(show)
    try:
        assert shown.returncode == 0, shown.stderr
        dsn = re.search(r"postgresql://oncekit:([^@]+)@", shown.stdout)
        assert dsn is not None and dsn.group(1) != "***", shown.stdout
    finally:
        assert sh(down).returncode == 0
    started = sh(up)
    try:
        assert started.returncode == 0, started.stderr
        assert "kafka bootstrap: 127.0.0.1:" in started.stdout and "postgresql://oncekit:***@127.0.0.1:" in started.stdout
        ready = sh(status)
        assert "kafka: ready" in ready.stdout and "postgres: ready" in ready.stdout
    finally:
        stopped = sh(down)
    assert stopped.returncode == 0 and "services down" in stopped.stdout
    assert sh(status).returncode == 1

"""The kit against secured services, as production runs them: the local backend's Kafka broker
with SASL_SSL (SCRAM-SHA-256) as its only client listener and a PostgreSQL server that takes only
TLS with scram-sha-256 (``sslmode=verify-full``), both with certificates of a CA the test makes
(:func:`~oncekit.connectors.services.start_secured_services`).

The source and every sink protocol run in one query, ``oncekit doctor`` and an ``oncekit
verify`` campaign (the PostgreSQL crash faults) run against them, and a wrong password or an
untrusted certificate fails at once with an error naming the service. No secret may show anywhere: errors, reprs, the
kit's and librdkafka's log lines, the JVM's output, Spark's plans and progress.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from oncekit.connectors import Services
from oncekit.connectors.kafka_admin import check_broker, create_topic
from oncekit.connectors.postgres import check_server, connect
from oncekit.connectors.services import start_secured_services
from oncekit.connectors.services.tls import CertificateAuthority
from oncekit.core.errors import AccessError
from oncekit.core.fanout import fan_out
from oncekit.sinks.kafka import PROTOCOLS as KAFKA_PROTOCOLS
from oncekit.sinks.kafka import kafka_sink
from oncekit.sinks.postgres import PROTOCOLS as POSTGRES_PROTOCOLS
from oncekit.sinks.postgres import postgres_sink
from oncekit.verify import Fault, compare, integers, prepared_transactions, produce_input, read_committed, run_campaign, table_ids
from tests.eos.pipeline import run_available_now
from tests.eos.test_verify_campaign import record

pytestmark = [pytest.mark.services, pytest.mark.spark]

COUNT = 600


@pytest.fixture(scope="module")
def secured() -> Iterator[Services]:
    started = start_secured_services()
    with started.running():
        yield started


@pytest.fixture(scope="module")
def secrets(secured: Services) -> list[str]:
    """Every secret of the secured services: what must never be shown."""
    password = secured.postgres.dsn.split("://", 1)[1].split("@", 1)[0].split(":", 1)[1]
    return [secured.kafka.client["sasl.password"], password]


@pytest.fixture(scope="module")
def untrusted(tmp_path_factory: pytest.TempPathFactory) -> CertificateAuthority:
    """A CA the services' certificates do not chain to."""
    return CertificateAuthority.create(tmp_path_factory.mktemp("untrusted-ca"), "someone else's CA")


def assert_hidden(secrets: list[str], *texts: str) -> None:
    for text in texts:
        for secret in secrets:
            assert secret not in text, f"a secret shows in: {text[:300]}"


def test_secured_source_and_every_sink_exactly_once(spark: Any, secured: Services, secrets: list[str],
                                                   unique_name: str, tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                   capfd: pytest.CaptureFixture[str]) -> None:
    """One query reads the secured broker and writes every record through every sink protocol
    (four PostgreSQL, three Kafka, by fan-out): each target holds the input exactly once."""
    caplog.set_level(logging.INFO)
    kafka, dsn = secured.kafka.config, secured.postgres.dsn
    source = unique_name.replace("_", "-")
    create_topic(kafka, source, partitions=2)
    expected = produce_input(kafka, source, COUNT)
    targets: dict[str, Any] = {}
    with connect(dsn, autocommit=True) as conn:
        for protocol in POSTGRES_PROTOCOLS:
            name = f"{unique_name}_{protocol.replace('-', '_')}"
            conn.execute(f"CREATE TABLE {name} (id bigint {'PRIMARY KEY' if protocol == 'idempotent' else ''}, payload text)")
            targets[name] = postgres_sink(dsn, name, protocol, columns=("id", "payload"),
                                          key_columns=("id",) if protocol == "idempotent" else ())
    for protocol in KAFKA_PROTOCOLS:
        name = f"{source}-{protocol}"
        create_topic(kafka, name, partitions=2)
        targets[name] = kafka_sink(kafka.bootstrap_servers, name, protocol, columns=("key", "value"),
                                   client=dict(kafka.client))
    routes = ", ".join(f"'{name}'" for name in targets)
    frame = integers(spark, kafka, source, 300).selectExpr(
        "id", "payload", "CAST(id AS STRING) AS key", "CAST(id AS STRING) AS value", f"explode(array({routes})) AS target")

    query = run_available_now(frame, fan_out(targets), str(tmp_path / "checkpoint"))

    for name, sink in targets.items():
        got = table_ids(dsn, name) if name.startswith(unique_name) else [
            int(v) for v in read_committed(kafka, name, COUNT, timeout_s=60)]
        verdict = compare(expected, got)
        assert verdict.exactly_once, f"{name} ({sink.protocol}): {verdict.summary()}"
    assert prepared_transactions(dsn, unique_name) == []
    # What Spark shows of the query: its plans (the SQL tab of the UI shows the same), its
    # progress (the Structured Streaming tab), and the JVM's own log lines.
    plans = query.query._jsq.explainInternal(True)
    progress = json.dumps([json.loads(p.json) for p in query.recentProgress])
    assert "oncekit-kafka" in plans
    assert_hidden(secrets, plans, progress, caplog.text, *capfd.readouterr(), repr(kafka), repr(targets), repr(secured))


def test_secured_doctor_passes(secured: Services, secrets: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """``oncekit doctor`` with the broker's client settings file and the TLS DSN."""
    from oncekit import doctor
    from oncekit.reference.config import load_with_services

    overrides = {"services.kafka_bootstrap": secured.kafka.bootstrap_servers,
                 "services.kafka_client_config": str(secured.kafka.client_config),  # type: ignore[attr-defined]
                 "services.postgres_dsn": secured.postgres.dsn}
    code = doctor.main(doctor.target_from_config(load_with_services(None, overrides)))
    out = capsys.readouterr().out
    assert code == 0, out
    assert "OK    kafka " in out and "OK    postgres " in out, out
    assert_hidden(secrets, out)


@pytest.mark.long(80)
def test_secured_verify_postgres_crash_campaign_exactly_once(secured: Services, secrets: list[str],
                                                             campaign_tables: list[str]) -> None:
    """``oncekit verify``'s campaign on the secured services, with the PostgreSQL faults at the
    sink's steps (one campaign serves both, for the suite's time): the server killed -9 while the
    sink's sessions run PREPARE TRANSACTION and between two COMMIT PREPARED of a checkpoint
    (crash recovery keeps what was prepared), the sink's sessions ended by pg_terminate_backend,
    and the server restarted while a batch writes. Each lands at its step and ends exactly-once
    with nothing left prepared. The driver process gets the secrets by environment, never on
    its command line."""
    faults = [Fault("postgres-kill-prepare", outage_s=1), Fault("postgres-kill-commit-prepared", outage_s=1),
              Fault("postgres-terminate"), Fault("postgres-restart-batch", outage_s=1)]
    report = run_campaign("postgres-two-phase-commit", secured, faults)
    text = record(report, "postgres-crashes-secured", campaign_tables)
    assert report.passed and all(r.fired for r in report.results), f"{text}\n{report.log}"
    assert [r.verdict for r in report.results] == ["exactly-once"] * len(faults), text
    prepare, commit = report.results[0].detail, report.results[1].detail
    assert "'PREPARE'" in prepare, text  # the sessions were inside PREPARE TRANSACTION when the server died
    assert re.search(r"kept ([1-9]\d*) of \1 prepared", commit), text  # a prepared one outlived the kill
    assert_hidden(secrets, text, report.log)


def test_secured_wrong_password_fails_fast_naming_the_service(secured: Services, secrets: list[str],
                                                              caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    wrong = "not-the-password-4711"
    kafka = secured.kafka
    started = time.monotonic()
    with pytest.raises(AccessError, match=rf"kafka at {kafka.bootstrap_servers}: .*invalid credentials") as kafka_error:
        check_broker(kafka.bootstrap_servers, {**kafka.client, "sasl.password": wrong})
    dsn = secured.postgres.dsn.replace(secrets[1], wrong)
    with pytest.raises(AccessError, match=r"postgres at postgresql://oncekit:\*\*\*@.*password authentication failed") as pg_error:
        check_server(dsn)
    assert time.monotonic() - started < 15
    shown = [str(kafka_error.value), repr(kafka_error.value), str(pg_error.value), repr(pg_error.value), caplog.text]
    assert_hidden([*secrets, wrong], *shown)


def test_secured_untrusted_certificate_fails_fast_naming_the_service(secured: Services, secrets: list[str],
                                                                     untrusted: CertificateAuthority) -> None:
    kafka = secured.kafka
    started = time.monotonic()
    with pytest.raises(AccessError, match=rf"kafka at {kafka.bootstrap_servers}: .*certificate verify failed"):
        check_broker(kafka.bootstrap_servers, {**kafka.client, "ssl.ca.location": str(untrusted.certificate)})
    trusted = secured.postgres.dsn.split("sslrootcert=")[1]
    with pytest.raises(AccessError, match=r"postgres at postgresql://oncekit:\*\*\*@.*certificate verify failed"):
        check_server(secured.postgres.dsn.replace(trusted, str(untrusted.certificate)))
    with pytest.raises(AccessError, match=r"postgres at .*no pg_hba.conf entry .* no encryption"):
        check_server(secured.postgres.dsn.replace("sslmode=verify-full", "sslmode=disable"))
    assert time.monotonic() - started < 15


def test_secured_sink_preflight_with_wrong_password_fails_fast(secured: Services, unique_name: str) -> None:
    """A Kafka sink's preflight (the first thing its query does) names the refusal at once."""
    from oncekit.sinks.kafka.transactional import KafkaTransactionalSink

    config = kafka_sink(secured.kafka.bootstrap_servers, unique_name.replace("_", "-"), "transactional",
                        client={**secured.kafka.client, "sasl.password": "wrong"})
    started = time.monotonic()
    with pytest.raises(AccessError, match="invalid credentials"):
        KafkaTransactionalSink(config).preflight()
    assert time.monotonic() - started < 15

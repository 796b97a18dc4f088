from __future__ import annotations

from pathlib import Path

import pytest

from oncekit.connectors import KafkaConfig, PostgresConfig, redact_config, redact_dsn
from oncekit.connectors.kafka_broker import client_properties
from oncekit.core.errors import ConfigError


@pytest.mark.parametrize(
    "dsn",
    [
        "postgresql://user:s3cr3t@db:5432/app",
        "postgres://user:s3cr3t@db/app?sslmode=require",
        "host=db user=app password=s3cr3t dbname=app",
        "host=db password = 's3 cr3t' dbname=app",
    ],
)
def test_redact_dsn_any_form_hides_password(dsn: str) -> None:
    redacted = redact_dsn(dsn)
    assert "s3cr3t" not in redacted and "s3 cr3t" not in redacted
    assert "***" in redacted


def test_redact_dsn_without_password_unchanged() -> None:
    assert redact_dsn("postgresql://user@db/app") == "postgresql://user@db/app"


def test_postgres_config_repr_hides_password() -> None:
    assert "s3cr3t" not in repr(PostgresConfig("postgresql://u:s3cr3t@h/db"))


def test_kafka_config_repr_hides_sasl_secrets() -> None:
    config = KafkaConfig("b:9092", {"sasl.password": "s3cr3t", "sasl.username": "me",
                                   "sasl.oauthbearer.config": "token=s3cr3t"})
    assert "s3cr3t" not in repr(config)
    assert "me" in repr(config)


def test_redact_config_keeps_ordinary_settings() -> None:
    assert redact_config({"acks": "all", "ssl.key.password": "x"}) == {"acks": "all", "ssl.key.password": "***"}


def test_kafka_config_settings_translate_underscores() -> None:
    assert KafkaConfig("b:1").settings(transactional_id="t") == {"bootstrap.servers": "b:1", "transactional.id": "t",
                                                                 "reconnect.backoff.max.ms": 1000,
                                                                 "socket.connection.setup.timeout.ms": 10_000}
    assert KafkaConfig("b:1", {"reconnect.backoff.max.ms": 5000}).settings()["reconnect.backoff.max.ms"] == 5000


def test_kafka_config_empty_bootstrap_is_config_error() -> None:
    with pytest.raises(ConfigError, match="bootstrap_servers"):
        KafkaConfig(" ")


def test_client_properties_file_read_and_its_secret_hidden_in_repr(tmp_path: Path) -> None:
    path = tmp_path / "client.properties"
    path.write_text("# secured cluster\nsecurity.protocol=SASL_SSL\n\nsasl.password = s3cr3t=x\n")
    client = client_properties(str(path))
    assert client == {"security.protocol": "SASL_SSL", "sasl.password": "s3cr3t=x"}
    assert "s3cr3t" not in repr(KafkaConfig("b:9093", client))


def test_client_properties_line_without_equals_is_config_error(tmp_path: Path) -> None:
    path = tmp_path / "client.properties"
    path.write_text("security.protocol SASL_SSL\n")
    with pytest.raises(ConfigError, match="line 1: expected key=value"):
        client_properties(str(path))


def test_pipeline_context_repr_hides_kafka_client_settings() -> None:
    from oncekit.verify import PipelineContext

    ctx = PipelineContext("b:9093", "in", "out", "/tmp/cp", kafka_client={"sasl.password": "s3cr3t"})
    assert "s3cr3t" not in repr(ctx) and "s3cr3t" not in repr(ctx.kafka)


@pytest.mark.parametrize("dsn", ["postgresql://u:s3cr3t@h:5432/db?sslmode=verify-full", "host=h user=u password=s3cr3t dbname=db"])
def test_postgres_sink_options_keep_the_password_apart_for_spark_to_redact(dsn: str) -> None:
    from oncekit.sinks.postgres import postgres_sink
    from oncekit.sinks.postgres.config import PostgresSinkConfig

    options = postgres_sink(dsn, "t").to_options()
    assert options["password"] == "s3cr3t"  # a key Spark's spark.redaction.regex hides in plans and the UI
    assert not [key for key, value in options.items() if "s3cr3t" in value and key != "password"]
    again = PostgresSinkConfig.from_options(options, ("id",))
    assert again.dsn == dsn

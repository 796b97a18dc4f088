from __future__ import annotations

import pytest

from oncekit.connectors import KafkaConfig, PostgresConfig, redact_config, redact_dsn
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
    assert KafkaConfig("b:1").settings(transactional_id="t") == {"bootstrap.servers": "b:1", "transactional.id": "t"}


def test_kafka_config_empty_bootstrap_is_config_error() -> None:
    with pytest.raises(ConfigError, match="bootstrap_servers"):
        KafkaConfig(" ")

from __future__ import annotations

import pytest

from oncekit.core.errors import ConfigError
from oncekit.sinks.kafka import KafkaSinkConfig, kafka_sink
from oncekit.sinks.postgres import PostgresSinkConfig, postgres_sink


def test_sink_ids_default_from_target() -> None:
    assert postgres_sink("postgresql://u:p@h/d", "app.balances").sink_id == "pg-app.balances"
    assert kafka_sink("b:1", "pay ments").sink_id == "kafka-pay_ments"


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: postgres_sink("postgresql://h/d", "t", "three-phase"), "unknown protocol"),
        (lambda: postgres_sink("postgresql://h/d", ""), "target"),
        (lambda: postgres_sink("postgresql://h/d", "t", sink_id="a:b"), "sink id"),
        (lambda: postgres_sink("postgresql://h/d", "t", "idempotent"), "key_columns"),
        (lambda: postgres_sink("postgresql://h/d", "t", on_conflict="merge"), "on_conflict"),
        (lambda: kafka_sink("b:1", "t", "exactly"), "unknown protocol"),
        (lambda: KafkaSinkConfig.from_options({"topic": "t"}, ("value",)), "bootstrap"),
        (lambda: KafkaSinkConfig.from_options({"kafka.bootstrap.servers": "b:1", "topic": "t"}, ("id",)), "value column"),
    ],
)
def test_sink_config_errors_say_what_to_fix(make: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        make()  # type: ignore[operator]


def test_sink_configs_round_trip_through_spark_options() -> None:
    postgres = postgres_sink("postgresql://u:p@h/d", "t", "write-ahead-log", key_columns=("id",), dead_letter_table="dl")
    assert PostgresSinkConfig.from_options(postgres.to_options(), ()) == postgres
    kafka = kafka_sink("b:1", "t", "write-ahead-log", client={"acks": "all"}, dead_letter_topic="dl")
    assert KafkaSinkConfig.from_options(kafka.to_options(), ()) == kafka


def test_kafka_sink_config_repr_hides_sasl_password() -> None:
    assert "s3cr3t" not in repr(kafka_sink("b:1", "t", client={"sasl.password": "s3cr3t"}))


def test_the_kafka_sink_names_the_columns_of_sparks_kafka_sink_it_does_not_write() -> None:
    from oncekit.sinks.kafka._common import unwritten_columns

    assert unwritten_columns(("key", "value", "topic", "partition", "offset", "headers")) == ["topic", "partition",
                                                                                              "headers"]
    assert unwritten_columns(("key", "value")) == []

"""Everything a job needs is importable from ``oncekit`` and listed by ``dir`` (issue 34 item 6);
the sink builders take typed keywords, and a misspelt one is refused at once."""

from __future__ import annotations

import pytest

import oncekit


def test_every_public_name_resolves_and_is_listed() -> None:
    assert {"start_query", "kafka_stream", "postgres_sink", "kafka_sink", "fan_out", "OncekitQuery", "spark_session",
            "supervise", "FixedDelay", "stand_by", "FencedError", "OncekitError"} <= set(dir(oncekit))
    for name in oncekit.__all__:
        assert getattr(oncekit, name) is not None, name


def test_the_sink_builders_refuse_an_unknown_option_and_protocol() -> None:
    with pytest.raises(TypeError, match="key_colums"):
        oncekit.postgres_sink("postgresql://u@h/db", "t", "idempotent", key_colums=("id",))  # type: ignore[call-arg]
    with pytest.raises(oncekit.ConfigError, match="unknown protocol 'two-phase'"):
        oncekit.kafka_sink("broker:9092", "topic", "two-phase")  # type: ignore[arg-type]
    assert oncekit.kafka_sink("broker:9092", "t", client={"security.protocol": "SSL"}).client == {"security.protocol": "SSL"}

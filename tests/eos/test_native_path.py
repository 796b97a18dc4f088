"""Spark's own way to start a sink, ``writeStream.format("oncekit-...")...start()`` (issue 34
item 3): it would run without the lease, the fencing epoch, the batch deadline and the
checkpoint-complete listener that make the sink exactly-once, so its first writer refuses it,
naming what to call instead, before anything is written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from oncekit.connectors import KafkaConfig
from oncekit.sinks import register
from oncekit.sinks.postgres import postgres_sink
from oncekit.verify.io import prepare_target
from tests.eos.pipeline import integers, prepared_transactions, produce_input, table_ids

pytestmark = [pytest.mark.services, pytest.mark.spark]


def test_a_query_started_with_plain_format_is_refused_naming_start_query(
    spark: Any, kafka: KafkaConfig, postgres_dsn: str, topic: str, unique_name: str, tmp_path: Path,
) -> None:
    produce_input(kafka, topic, 100)
    prepare_target("postgres-two-phase-commit", kafka, postgres_dsn, unique_name)
    sink = postgres_sink(postgres_dsn, unique_name, "two-phase-commit")
    register(spark)
    query = (integers(spark, kafka, topic).writeStream.format(sink.format_name).options(**sink.to_options())
             .option("checkpointLocation", str(tmp_path / "checkpoint")).trigger(availableNow=True).start())
    with pytest.raises(Exception, match=r"ConfigError: .*oncekit\.start_query"):
        query.awaitTermination(120)
    assert table_ids(postgres_dsn, unique_name) == []
    assert prepared_transactions(postgres_dsn, unique_name) == []

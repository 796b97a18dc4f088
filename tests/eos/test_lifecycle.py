"""The lifecycle campaign of ``oncekit verify --lifecycle`` against a real broker whose consumer
groups' offsets expire after a minute (issue 21): markers outlive offsets retention, speculation
and a replay with another partitioning are refused at start, slow upstream input commits,
savepoints are not taken from or restored beside a running query. Every case must end as it
expects; the table goes to the end-of-run summary."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from oncekit.connectors import KafkaConfig
from oncekit.connectors.services import start_kafka
from oncekit.verify.lifecycle import BROKER_SETTINGS, Lifecycle, table

pytestmark = [pytest.mark.services, pytest.mark.spark]


@pytest.fixture(scope="module")
def expiring_kafka() -> Iterator[KafkaConfig]:
    kafka = start_kafka(os.environ.get("ONCEKIT_TEST_BACKEND", "auto"), settings=BROKER_SETTINGS)
    try:
        yield KafkaConfig(kafka.bootstrap_servers)
    finally:
        kafka.remove()


@pytest.mark.long(420)
def test_lifecycle_campaign_every_case_as_expected(spark: Any, expiring_kafka: KafkaConfig, tmp_path: Path,
                                                   crash_dir: Path, campaign_tables: list[str]) -> None:
    results = Lifecycle(spark, expiring_kafka, tmp_path, crash_dir).run()
    text = table(results)
    campaign_tables.append(text)
    assert [r.case for r in results if not r.passed] == [], text

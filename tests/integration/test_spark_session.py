"""A Spark session starts with oncekit's defaults."""

from __future__ import annotations

import os
from typing import Any

import pytest

from oncekit.core.spark.session import ROCKSDB_PROVIDER

pytestmark = pytest.mark.spark


def test_spark_session_has_project_defaults(spark: Any) -> None:
    conf = spark.conf
    assert conf.get("spark.sql.streaming.stateStore.providerClass") == ROCKSDB_PROVIDER
    assert int(conf.get("spark.sql.shuffle.partitions")) == max(2, os.cpu_count() or 2)
    assert conf.get("spark.ui.enabled") == "false"
    assert spark.range(10).selectExpr("sum(id)").first()[0] == 45

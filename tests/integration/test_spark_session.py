"""A Spark session from ``spark_session`` fills oncekit's defaults only where the job and the
cluster left a setting unset (issue 34 item 5)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from oncekit.core.spark.session import ROCKSDB_PROVIDER

pytestmark = pytest.mark.spark


def test_spark_session_has_project_defaults(spark: Any) -> None:
    conf = spark.conf
    assert conf.get("spark.sql.streaming.stateStore.providerClass") == ROCKSDB_PROVIDER
    assert int(conf.get("spark.sql.shuffle.partitions")) == max(2, os.cpu_count() or 2)
    assert spark.range(10).selectExpr("sum(id)").first()[0] == 45


SHOW = """
import json
from oncekit.core.spark.session import spark_session
spark = spark_session("settings", master="local[1]")
keys = ("spark.sql.shuffle.partitions", "spark.sql.execution.arrow.pyspark.enabled",
        "spark.sql.streaming.stateStore.providerClass")
print(json.dumps({**{k: spark.conf.get(k) for k in keys},
                  "spark.ui.enabled": spark.sparkContext.getConf().get("spark.ui.enabled", "unset"),
                  "log level": spark._jvm.org.apache.logging.log4j.LogManager.getRootLogger().getLevel().toString()}))
"""


def test_spark_session_never_overrides_what_spark_submit_was_given() -> None:
    env = {**os.environ, "PYSPARK_SUBMIT_ARGS": "--conf spark.sql.shuffle.partitions=7 "
           "--conf spark.sql.execution.arrow.pyspark.enabled=false --conf spark.log.level=INFO pyspark-shell"}
    out = subprocess.run([sys.executable, "-c", SHOW], env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["spark.sql.shuffle.partitions"] == "7"  # --conf: the job's choice
    assert seen["spark.sql.execution.arrow.pyspark.enabled"] == "false"
    assert seen["spark.sql.streaming.stateStore.providerClass"] == ROCKSDB_PROVIDER  # unset: the kit's default
    assert seen["spark.ui.enabled"] == "unset"  # the UI is the cluster's business
    assert seen["log level"] == "INFO"  # spark.log.level: the job's choice, not the kit's WARN


def test_spark_session_quiets_only_sparks_default_logging() -> None:
    """Nobody chose logging (Spark's default log4j profile, no ``spark.log.level``): WARN,
    instead of a line per task at INFO."""
    env = {k: v for k, v in os.environ.items() if k != "PYSPARK_SUBMIT_ARGS"}
    out = subprocess.run([sys.executable, "-c", SHOW], env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1])["log level"] == "WARN"

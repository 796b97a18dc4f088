"""A user's job on a Spark cluster from the built wheel (issue 34 item 2), with the deployment
page's commands: the wheel installed into a fresh virtual environment with only the supported pyspark, a job file outside the
checkout that uses only ``from oncekit import ...``, submitted with ``spark-submit`` to a
standalone cluster whose executors run the same environment (at the same path on every node,
as a cluster image gives it). The driver crashes once in its commit; the job submitted again
ends exactly-once, nothing prepared."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from oncekit.connectors import KafkaConfig
from oncekit.core.crash import CRASH_DIR_ENV, arm, fired
from oncekit.verify import compare
from oncekit.verify.io import prepare_target
from tests.docs.console import console_commands
from tests.eos.pipeline import prepared_transactions, produce_input, table_ids

pytestmark = [pytest.mark.services, pytest.mark.spark]

JOB = '''\
"""A user's job: Kafka topic into a PostgreSQL table, exactly once."""
import os

from pyspark.sql import SparkSession

from oncekit import kafka_stream, postgres_sink, start_query

spark = SparkSession.builder.appName("user-job").getOrCreate()
events = kafka_stream(spark, os.environ["JOB_BOOTSTRAP"], os.environ["JOB_TOPIC"], starting_offsets="earliest",
                      max_offsets_per_trigger=200)
rows = events.selectExpr("CAST(CAST(value AS STRING) AS BIGINT) AS id", "CAST(value AS STRING) AS payload")
sink = postgres_sink(os.environ["JOB_DSN"], os.environ["JOB_TABLE"], "two-phase-commit")
query = start_query(rows.where("id IS NOT NULL"), sink, os.environ["JOB_CHECKPOINT"], trigger={"availableNow": True})
query.await_termination()
print("job done")
'''


def pyspark_version() -> str:
    import pyspark

    return pyspark.__version__


@pytest.fixture(scope="module")
def job_env(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtual environment made as the deployment page says (the wheel ``make wheel``
    built, the installed pyspark for the cluster's version), then the getting-started page's
    install run in it, which finds everything there."""
    venv = tmp_path_factory.mktemp("job-env") / "venv"
    dist = f"{wheel.parent}/"
    (make,) = console_commands("deploy-standalone", {"/opt/job": str(venv), "dist/": dist,
                                                     "'pyspark==4.3.0'": f"'pyspark=={pyspark_version()}'"})[:1]
    install = console_commands("install", {"pip install": f"{venv}/bin/pip install", "dist/": dist})[1]
    for command in (make, install):
        subprocess.run(["bash", "-c", command], check=True, env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1",
                                                                  "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"})
    return venv


@pytest.mark.long(240)
def test_a_users_job_from_the_wheel_on_a_standalone_cluster_crashes_once_and_ends_exactly_once(
    kafka: KafkaConfig, postgres_dsn: str, topic: str, unique_name: str, tmp_path: Path, crash_dir: Path,
    job_env: Path, spark_cluster: Any,
) -> None:
    python = job_env / "bin" / "python"
    found = subprocess.run([str(python), "-c", "import oncekit; print(oncekit.__file__)"], cwd=tmp_path,
                           capture_output=True, text=True, check=True).stdout.strip()
    assert found.startswith(str(job_env)), f"oncekit imported from {found}, not the job's environment"
    job = tmp_path / "job.py"
    job.write_text(JOB)
    expected = produce_input(kafka, topic, 1_000)
    prepare_target("postgres-two-phase-commit", kafka, postgres_dsn, unique_name)
    env = {key: value for key, value in os.environ.items()
           if key not in ("SPARK_HOME", "PYTHONPATH", "VIRTUAL_ENV", "PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON")}
    env.update(JOB_BOOTSTRAP=kafka.bootstrap_servers, JOB_TOPIC=topic, JOB_DSN=postgres_dsn, JOB_TABLE=unique_name,
               JOB_CHECKPOINT=str(tmp_path / "checkpoint"), PATH=f"{job_env / 'bin'}:{os.environ['PATH']}")
    submit = console_commands("deploy-standalone", {"/opt/job": str(job_env), "spark://master:7077": spark_cluster.url})[1]
    conf = tmp_path / "conf"  # the test's own settings, where spark-submit reads a cluster's defaults
    conf.mkdir()
    (conf / "spark-defaults.conf").write_text(f"spark.executorEnv.{CRASH_DIR_ENV} {crash_dir}\n"
                                              "spark.executor.memory 1g\n")
    env["SPARK_CONF_DIR"] = str(conf)

    def run(log: str) -> int:
        with (tmp_path / log).open("wb") as out:
            return subprocess.run(["bash", "-c", submit], cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT,
                                  timeout=300).returncode

    arm(crash_dir, "driver_after_journal", batch_id=2)
    code = run("first.log")
    assert fired(crash_dir) == ["driver_after_journal"], (tmp_path / "first.log").read_text()[-3000:]
    assert code != 0, "the job did not fail when its driver commit crashed"
    assert run("second.log") == 0, (tmp_path / "second.log").read_text()[-3000:]
    assert "job done" in (tmp_path / "second.log").read_text()
    verdict = compare(expected, table_ids(postgres_dsn, unique_name))
    assert verdict.exactly_once, verdict.summary()
    assert prepared_transactions(postgres_dsn, unique_name) == []

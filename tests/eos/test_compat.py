"""The compatibility table's Spark rows beyond the installed pyspark (make test-long): the built
wheel and each older supported PySpark in an environment of their own, a user's job run by
``oncekit run`` there, its driver commit crashed once and restarted in place, exactly once."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from oncekit.connectors import KafkaConfig
from oncekit.core.compat import spark_supported
from oncekit.core.crash import arm, fired
from oncekit.verify import compare
from oncekit.verify.io import PipelineOutput, prepare_target
from tests.eos.pipeline import produce_input
from tests.eos.test_run_command import JOB

pytestmark = [pytest.mark.services, pytest.mark.spark]

SPARK_ROWS = ("4.2.1",)
"""The PySpark versions the table says the suite runs besides the installed one (docs/deployment.md)."""


@pytest.mark.full_size
@pytest.mark.long(900)
@pytest.mark.parametrize("pyspark_version", SPARK_ROWS)
def test_a_users_job_on_an_older_supported_spark_restarts_in_place_and_ends_exactly_once(
    wheel: Path, kafka: KafkaConfig, postgres_dsn: str, topic: str, unique_name: str, tmp_path: Path, crash_dir: Path,
    pyspark_version: str,
) -> None:
    assert spark_supported(pyspark_version)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", str(wheel), f"pyspark=={pyspark_version}"], check=True,
                   env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    found = subprocess.run([str(venv / "bin" / "python"), "-c", "import pyspark; print(pyspark.__version__)"],
                           capture_output=True, text=True, check=True).stdout.strip()
    assert found == pyspark_version
    (tmp_path / "job.py").write_text(JOB)
    expected = produce_input(kafka, topic, 1_000)
    prepare_target("postgres-write-ahead-log", kafka, postgres_dsn, unique_name)
    checkpoint = tmp_path / "checkpoint"
    env = {key: value for key, value in os.environ.items()
           if key not in ("SPARK_HOME", "PYTHONPATH", "VIRTUAL_ENV", "PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON")}
    env.update(PATH=f"{venv / 'bin'}:{os.environ['PATH']}", JOB_BOOTSTRAP=kafka.bootstrap_servers, JOB_TOPIC=topic,
               JOB_DSN=postgres_dsn, JOB_TABLE=unique_name, JOB_CHECKPOINT=str(checkpoint), JOB_UNTIL="drained",
               SPARK_MASTER="local[2,4]")
    arm(crash_dir, "driver_after_journal", batch_id=2)
    command = [str(venv / "bin" / "oncekit"), "run", "job.py", "--restart", "fixed-delay:attempts=2,delay_s=1"]
    out = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert fired(crash_dir) == ["driver_after_journal"]
    assert "job job.py finished (1 restarts)" in out.stdout, out.stdout
    output = PipelineOutput("postgres", kafka, postgres_dsn, unique_name)
    verdict = compare(expected, output.read())
    assert verdict.exactly_once, verdict.summary()
    assert output.left_open(str(checkpoint)) == []

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
from tests.eos.test_run_command import restarts_in_place_exactly_once

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
    env = {key: value for key, value in os.environ.items()
           if key not in ("SPARK_HOME", "PYTHONPATH", "VIRTUAL_ENV", "PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON")}
    env["PATH"] = f"{venv / 'bin'}:{os.environ['PATH']}"
    restarts_in_place_exactly_once(str(venv / "bin" / "oncekit"), env, kafka, postgres_dsn, topic, unique_name, tmp_path,
                                   crash_dir)

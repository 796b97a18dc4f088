"""``oncekit run`` on a user's job (issue 34 item 4): a job file outside the checkout, a function
that starts its query with ``from oncekit import ...``, run under the command's restart strategy.
Its driver commit crashes once: the strategy restarts it in place, and the table ends
exactly-once, nothing staged left."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from oncekit.connectors import KafkaConfig
from oncekit.core.crash import arm, fired
from oncekit.verify import compare
from oncekit.verify.io import PipelineOutput, prepare_target
from tests.eos.pipeline import produce_input

pytestmark = [pytest.mark.services, pytest.mark.spark]

JOB = '''\
import os

from oncekit import kafka_stream, postgres_sink, start_query


def start(spark):
    events = kafka_stream(spark, os.environ["JOB_BOOTSTRAP"], os.environ["JOB_TOPIC"], starting_offsets="earliest",
                          max_offsets_per_trigger=200)
    rows = events.selectExpr("TRY_CAST(CAST(value AS STRING) AS BIGINT) AS id", "CAST(value AS STRING) AS payload")
    sink = postgres_sink(os.environ["JOB_DSN"], os.environ["JOB_TABLE"], "write-ahead-log")
    return start_query(rows.where("id IS NOT NULL"), sink, os.environ["JOB_CHECKPOINT"], trigger={"availableNow": True})
'''


def test_oncekit_run_restarts_a_users_job_in_place_and_it_ends_exactly_once(
    kafka: KafkaConfig, postgres_dsn: str, topic: str, unique_name: str, tmp_path: Path, crash_dir: Path,
) -> None:
    (tmp_path / "job.py").write_text(JOB)
    expected = produce_input(kafka, topic, 1_000)
    prepare_target("postgres-write-ahead-log", kafka, postgres_dsn, unique_name)
    checkpoint = tmp_path / "checkpoint"
    env = {**os.environ, "JOB_BOOTSTRAP": kafka.bootstrap_servers, "JOB_TOPIC": topic, "JOB_DSN": postgres_dsn,
           "JOB_TABLE": unique_name, "JOB_CHECKPOINT": str(checkpoint), "SPARK_MASTER": "local[2,4]"}
    arm(crash_dir, "driver_after_journal", batch_id=2)
    command = [str(Path(sys.executable).parent / "oncekit"), "run", "job.py", "--restart", "fixed-delay:attempts=2,delay_s=1"]
    out = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert fired(crash_dir) == ["driver_after_journal"]
    assert "job job.py finished (1 restarts)" in out.stdout, out.stdout
    output = PipelineOutput("postgres", kafka, postgres_dsn, unique_name)
    verdict = compare(expected, output.read())
    assert verdict.exactly_once, verdict.summary()
    assert output.left_open(str(checkpoint)) == []

"""``oncekit run``, ``oncekit savepoint`` and ``oncekit doctor`` on a user's job (issue 34 item 4):
a job file outside the checkout, a function that starts its query with ``from oncekit import ...``.

- Run under the command's restart strategy, its driver commit crashes once: the strategy restarts
  it in place, and the table ends exactly-once, nothing staged left.
- Running with a processing-time trigger, it is stopped with a savepoint by ``oncekit savepoint
  create`` from another process (through the checkpoint storage, not the process table); the
  savepoint restored into a new checkpoint root, the job drains the rest: exactly-once.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from oncekit.connectors import KafkaConfig
from oncekit.core.crash import arm, fired
from oncekit.core.spark_log import SparkLog
from oncekit.verify import compare
from oncekit.verify.io import PipelineOutput, prepare_target
from tests.eos.pipeline import produce_input

pytestmark = [pytest.mark.services, pytest.mark.spark]

ONCEKIT = str(Path(sys.executable).parent / "oncekit")

JOB = '''\
import os

from oncekit import Trigger, kafka_stream, postgres_sink, start_query


def start(spark):
    events = kafka_stream(spark, os.environ["JOB_BOOTSTRAP"], os.environ["JOB_TOPIC"], starting_offsets="earliest",
                          max_offsets_per_trigger=200)
    rows = events.selectExpr("TRY_CAST(CAST(value AS STRING) AS BIGINT) AS id", "CAST(value AS STRING) AS payload")
    sink = postgres_sink(os.environ["JOB_DSN"], os.environ["JOB_TABLE"], "write-ahead-log")
    trigger = Trigger(available_now=True) if os.environ.get("JOB_UNTIL") == "drained" else Trigger(processing_time="1 second")
    return start_query(rows.where("id IS NOT NULL"), sink, os.environ["JOB_CHECKPOINT"], trigger=trigger)
'''


def restarts_in_place_exactly_once(oncekit: str, env: dict[str, str], kafka: KafkaConfig, postgres_dsn: str,
                                   topic: str, table: str, work: Path, crash_dir: Path) -> None:
    """:data:`JOB` in ``work`` run by ``oncekit run`` (the ``oncekit`` command given, with ``env``)
    over 1,000 records, its driver commit crashed once: the restart strategy starts it again in
    place, once, and the table holds every record once, nothing staged left."""
    (work / "job.py").write_text(JOB)
    expected = produce_input(kafka, topic, 1_000)
    prepare_target("postgres-write-ahead-log", kafka, postgres_dsn, table)
    checkpoint = work / "checkpoint"
    env = {**env, "JOB_BOOTSTRAP": kafka.bootstrap_servers, "JOB_TOPIC": topic, "JOB_DSN": postgres_dsn,
           "JOB_TABLE": table, "JOB_CHECKPOINT": str(checkpoint), "JOB_UNTIL": "drained", "SPARK_MASTER": "local[2,4]"}
    arm(crash_dir, "driver_after_journal", batch_id=2)
    command = [oncekit, "run", "job.py", "--restart", "fixed-delay:attempts=2,delay_s=1"]
    out = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert fired(crash_dir) == ["driver_after_journal"]
    assert "job job.py finished (1 restarts)" in out.stdout, out.stdout
    output = PipelineOutput("postgres", kafka, postgres_dsn, table)
    verdict = compare(expected, output.read())
    assert verdict.exactly_once, verdict.summary()
    assert output.left_open(str(checkpoint)) == []


@pytest.mark.long(50)
def test_oncekit_run_restarts_a_users_job_in_place_and_it_ends_exactly_once(
    kafka: KafkaConfig, postgres_dsn: str, topic: str, unique_name: str, tmp_path: Path, crash_dir: Path,
) -> None:
    restarts_in_place_exactly_once(ONCEKIT, dict(os.environ), kafka, postgres_dsn, topic, unique_name, tmp_path, crash_dir)


@pytest.mark.long(90)
def test_oncekit_savepoint_stops_a_running_users_job_and_its_restore_ends_exactly_once_and_doctor_checks_it(
    kafka: KafkaConfig, postgres_dsn: str, topic: str, unique_name: str, tmp_path: Path,
) -> None:
    (tmp_path / "job.py").write_text(JOB)
    root, restored, saved = tmp_path / "checkpoints", tmp_path / "restored", tmp_path / "savepoints"
    expected = produce_input(kafka, topic, 600)
    prepare_target("postgres-write-ahead-log", kafka, postgres_dsn, unique_name)
    env = {**os.environ, "JOB_BOOTSTRAP": kafka.bootstrap_servers, "JOB_TOPIC": topic, "JOB_DSN": postgres_dsn,
           "JOB_TABLE": unique_name, "JOB_CHECKPOINT": str(root / "payments"), "SPARK_MASTER": "local[2,4]"}

    def oncekit(*args: str, **more: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([ONCEKIT, *args], cwd=tmp_path, env={**env, **more}, capture_output=True, text=True,
                              timeout=300)

    doctor = oncekit("doctor", "--bootstrap", kafka.bootstrap_servers, "--dsn", postgres_dsn, "--topic", topic,
                     "--checkpoint", str(root / "payments"))
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    assert f"OK    kafka topic {topic}" in doctor.stdout and postgres_dsn not in doctor.stdout, doctor.stdout

    running = subprocess.Popen([ONCEKIT, "run", "job.py"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while (SparkLog(str(root / "payments")).latest_completed() or 0) < 1:
            assert running.poll() is None and time.monotonic() < deadline, "the job committed no second batch"
            time.sleep(0.5)
        created = oncekit("savepoint", "create", "first", "--checkpoint-root", str(root), "--dir", str(saved),
                          "--timeout", "120")
        assert created.returncode == 0, created.stdout + created.stderr
        out, err = running.communicate(timeout=120)
    finally:
        running.kill()
    assert running.returncode == 0 and "stopped with savepoint first" in out, out[-2000:] + err[-3000:]

    expected += produce_input(kafka, topic, 400, first=600)
    restore = oncekit("savepoint", "restore", "first", "--dir", str(saved), "--into", str(restored))
    assert restore.returncode == 0 and "restored first into" in restore.stdout, restore.stdout + restore.stderr
    drained = oncekit("run", "job.py", JOB_CHECKPOINT=str(restored / "payments"), JOB_UNTIL="drained")
    assert drained.returncode == 0, drained.stdout[-2000:] + drained.stderr[-3000:]
    output = PipelineOutput("postgres", kafka, postgres_dsn, unique_name)
    verdict = compare(expected, output.read())
    assert verdict.exactly_once, verdict.summary()
    assert output.left_open(str(restored / "payments")) == []

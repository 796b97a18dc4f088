"""A user's job on a Spark cluster from the built wheel, as the deployment page's "Run on your
cluster" says: the wheel installed into a fresh virtual environment with only the supported
pyspark, the getting-started job file outside the checkout, submitted with ``spark-submit`` to a
standalone cluster whose executors run the same environment (at the same path on every node, as
a cluster image gives it); restarts in place, a savepoint from another process, its restore."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest

from oncekit.connectors import KafkaConfig
from oncekit.core.crash import CRASH_DIR_ENV, arm, fired
from oncekit.verify import compare
from tests.docs.console import console_commands
from tests.docs.test_examples import EXAMPLES, produce_payments, table_ids
from tests.eos.pipeline import prepared_transactions

pytestmark = [pytest.mark.services, pytest.mark.spark]

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


def wait_for(what: str, done: Callable[[], bool], job: subprocess.Popen[bytes] | None, log: Path,
             timeout_s: float = 240.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert job is None or job.poll() is None, f"the job ended (exit {job.poll()}) before {what}: {tail(log)}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:.0f} s: {tail(log)}"
        time.sleep(1.0)


def tail(log: Path) -> str:
    return log.read_text(errors="replace")[-3000:] if log.exists() else "(no log)"


@dataclass
class SubmittedJob:
    """The getting-started job file outside the checkout, its table and topic, and the page's
    commands with this cluster's addresses: what both tests submit."""

    tmp_path: Path
    env: dict[str, str]
    export: str
    submit: str
    create: str
    restore: str
    submit_restored: str
    root: Path
    dsn: str
    table: str
    topic: str

    def started(self, command: str, log: Path) -> subprocess.Popen[bytes]:
        with log.open("wb") as out:
            return subprocess.Popen(["bash", "-c", f"{self.export} && {command}"], cwd=self.tmp_path, env=self.env,
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def from_another_process(self, command: str) -> str:
        done = subprocess.run(["bash", "-c", f"{self.export} && {command}"], cwd=self.tmp_path, env=self.env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"{command}: {done.stdout[-2000:]}{done.stderr[-2000:]}"
        return done.stdout

    def all_in(self, wanted: list[str]) -> Callable[[], bool]:
        return lambda: Counter(wanted) <= Counter(table_ids(self.dsn, self.table))

    def exactly_once(self, expected: list[str]) -> None:
        verdict = compare(expected, table_ids(self.dsn, self.table))
        assert verdict.exactly_once, verdict.summary()
        assert prepared_transactions(self.dsn, self.table) == []


def submitted_job(job_env: Path, tmp_path: Path, kafka: KafkaConfig, dsn: str, unique_name: str, crash_dir: Path,
                  cluster_url: str, settings: str = "") -> SubmittedJob:
    """The job file copied out of the checkout, its table made, the environment's oncekit checked
    to be the wheel's; ``settings`` go to the test's spark-defaults.conf, where spark-submit reads
    a cluster's defaults."""
    python = job_env / "bin" / "python"
    found = subprocess.run([str(python), "-c", "import oncekit; print(oncekit.__file__)"], cwd=tmp_path,
                           capture_output=True, text=True, check=True).stdout.strip()
    assert found.startswith(str(job_env)), f"oncekit imported from {found}, not the job's environment"
    shutil.copy(EXAMPLES / "quickstart.py", tmp_path / "quickstart.py")  # outside the checkout
    topic, root = unique_name.replace("_", "-"), tmp_path / "checkpoints"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {unique_name} (event_id text, account_id int, amount_cents bigint)")
    env = {key: value for key, value in os.environ.items()
           if key not in ("SPARK_HOME", "PYTHONPATH", "VIRTUAL_ENV", "PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON")}
    env.update(TOPIC=topic, TABLE=unique_name, PATH=f"{job_env / 'bin'}:{os.environ['PATH']}")
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "spark-defaults.conf").write_text(f"spark.executorEnv.{CRASH_DIR_ENV} {crash_dir}\n"
                                              f"spark.executor.memory 1g\n{settings}")
    env["SPARK_CONF_DIR"] = str(conf)
    on_this_cluster = {"/opt/job": str(job_env), "spark://master:7077": cluster_url,
                       "s3a://bucket/checkpoints": str(root)}
    _, export, submit = console_commands("deploy-standalone", {**on_this_cluster, "kafka:9092": kafka.bootstrap_servers,
                                                               "postgresql://...": shlex.quote(dsn)})
    create, restore, submit_restored = console_commands("deploy-savepoint", on_this_cluster)
    return SubmittedJob(tmp_path, env, export, submit, create, restore, submit_restored, root, dsn, unique_name, topic)


def killed(jobs: list[subprocess.Popen[bytes]]) -> None:
    for job in jobs:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)


@pytest.mark.long(300)
def test_the_quickstart_job_submitted_from_the_wheel_restarts_in_place_stops_with_a_savepoint_and_resumes_from_it(
    kafka: KafkaConfig, postgres_dsn: str, unique_name: str, tmp_path: Path, crash_dir: Path, job_env: Path,
    spark_cluster: Any,
) -> None:
    """The deployment page's "Run on your cluster", as written, on a standalone cluster: the
    getting-started job file (``oncekit.run`` at its end) submitted with ``spark-submit`` from
    the environment built from the wheel. Its driver commit crashes once and the query starts
    again in the same driver; ``oncekit savepoint create`` from another process stops it; the
    savepoint is restored into a new root, and the job submitted from there drains more input.
    The table holds every well-formed payment once; nothing is left prepared."""
    job = submitted_job(job_env, tmp_path, kafka, postgres_dsn, unique_name, crash_dir, spark_cluster.url)
    expected = produce_payments(kafka, job.topic)
    first, second = tmp_path / "first.log", tmp_path / "second.log"
    jobs: list[subprocess.Popen[bytes]] = []
    try:
        arm(crash_dir, "driver_after_journal", batch_id=0)
        jobs.append(job.started(job.submit, first))
        wait_for("payment in the table", job.all_in(expected), jobs[0], first)
        assert fired(crash_dir) == ["driver_after_journal"], tail(first)
        assert "restart 1" in first.read_text(), f"the query did not start again in place: {tail(first)}"
        assert "savepoint before-upgrade" in job.from_another_process(job.create)
        assert jobs[0].wait(120) == 0, tail(first)
        assert "stopped with savepoint before-upgrade" in first.read_text()
        job.from_another_process(job.restore)
        expected += produce_payments(kafka, job.topic, seed=4)
        jobs.append(job.started(job.submit_restored, second))
        wait_for("payment of the second half in the table", job.all_in(expected), jobs[1], second)
        job.from_another_process(job.create.replace("before-upgrade", "done").replace(str(job.root), f"{job.root}-v2"))
        assert jobs[1].wait(120) == 0, tail(second)
    finally:
        killed(jobs)
    job.exactly_once(expected)


@pytest.mark.full_size
@pytest.mark.long(300)
def test_a_standby_submitted_beside_the_job_takes_over_on_the_cluster_after_a_kill(
    kafka: KafkaConfig, postgres_dsn: str, unique_name: str, tmp_path: Path, crash_dir: Path, job_env: Path,
    spark_cluster: Any,
) -> None:
    """The page's standby, on the standalone cluster: the same submit with ``--standby`` after the
    job file, each application given one of the worker's two cores (``spark.cores.max``, as the
    page says). The standby warms up and waits beside the active driver; the active driver is
    killed (-9, with its spark-submit); the standby takes over and drains the input that came
    after; a savepoint from another process stops it. Every payment is in the table once."""
    job = submitted_job(job_env, tmp_path, kafka, postgres_dsn, unique_name, crash_dir, spark_cluster.url,
                        settings="spark.cores.max 1\n")
    expected = produce_payments(kafka, job.topic)
    active, standby = tmp_path / "active.log", tmp_path / "standby.log"
    jobs: list[subprocess.Popen[bytes]] = []
    try:
        jobs.append(job.started(job.submit, active))
        wait_for("payment in the table", job.all_in(expected), jobs[0], active)
        jobs.append(job.started(f"{job.submit} --standby", standby))
        wait_for("the standby waiting", lambda: "waiting" in standby.read_text(errors="replace"), jobs[1], standby)
        assert "standby: taking over" not in standby.read_text(), tail(standby)
        os.killpg(jobs[0].pid, signal.SIGKILL)
        jobs[0].wait(30)
        expected += produce_payments(kafka, job.topic, seed=4)
        wait_for("payment sent after the kill in the table", job.all_in(expected), jobs[1], standby)
        assert "standby: taking over" in standby.read_text(), tail(standby)
        job.from_another_process(job.create.replace("before-upgrade", "done"))
        assert jobs[1].wait(120) == 0, tail(standby)
    finally:
        killed(jobs)
    job.exactly_once(expected)

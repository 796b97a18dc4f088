"""The getting-started page as a new user follows it, and the operations and deployment pages'
commands against the same job: every command is read from its page (tests/docs/console.py) and
run by ``bash`` with only the page's hosts, ports and paths replaced, on a real broker, a real
PostgreSQL server and a real Spark.

The story: ``oncekit produce`` sends the page's 10,000 payment events (with its malformed
records); ``oncekit run quickstart.py --ui`` runs the quickstart example until the table has
them, serving its status page; ``oncekit doctor`` checks the services both ways the pages show;
``oncekit status`` serves and prints the query's metrics; ``oncekit savepoint create`` stops the
running job with a savepoint, which is listed, restored into a new root with 8 state partitions
and deleted. The table then holds each payment's event id once: a multiset equal to the
produced payments'.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psycopg
import pytest

from oncekit.connectors import KafkaConfig
from oncekit.connectors.services.base import free_ports
from oncekit.reference.generator import Workload, events
from oncekit.verify import compare
from tests.docs.console import DOCS, console_commands

pytestmark = [pytest.mark.services, pytest.mark.spark]

BIN = str(Path(sys.executable).parent)


def sh(command: str, cwd: Path, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{command}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def get(url: str, showing: str, timeout_s: float = 60) -> str:
    """The page at ``url`` once it shows ``showing`` (a page samples every 2 s)."""
    deadline, text = time.monotonic() + timeout_s, ""
    while showing not in text:
        assert time.monotonic() < deadline, f"{url} does not show {showing!r}:\n{text}"
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                text = response.read().decode()
        except OSError:
            pass
        time.sleep(0.5)
    return text


def output(process: subprocess.Popen[str]) -> str:
    """What a process started here printed, the last of it, once it ended (killed if it had not)."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
    return process.communicate(timeout=30)[0][-5000:]


def table_ids(dsn: str, table: str) -> list[str]:
    with psycopg.connect(dsn) as conn:
        return [row[0] for row in conn.execute(f"SELECT event_id FROM {table}")]


@pytest.mark.long(65)
def test_getting_started_and_operations_commands_run_as_the_pages_show_them(
        kafka: KafkaConfig, postgres_dsn: str, unique_name: str, tmp_path: Path) -> None:
    topic, checkpoints = unique_name.replace("_", "-"), tmp_path / "checkpoints"
    ui_port, status_port = free_ports(2)
    shutil.copy(DOCS / "examples" / "quickstart.py", tmp_path / "quickstart.py")
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:  # the page's CREATE TABLE
        conn.execute(f"CREATE TABLE {unique_name} (event_id text, account_id int, amount_cents bigint)")
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "ONCEKIT_KAFKA_BOOTSTRAP": kafka.bootstrap_servers,
           "ONCEKIT_POSTGRES_DSN": postgres_dsn, "PAYMENTS_DSN": postgres_dsn, "TOPIC": topic, "TABLE": unique_name,
           "CHECKPOINTS": str(checkpoints)}
    payments = [json.loads(e.value)["event_id"] for e in events(Workload(count=10_000, duplicates=0)) if e.unique]

    produce, run = console_commands("quickstart-run", {"--topic payments": f"--topic {topic}",
                                                       "--ui 8765": f"--ui {ui_port}"})
    sh(produce, tmp_path, env)
    job = subprocess.Popen(["bash", "-c", f"exec {run}"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while len(table_ids(postgres_dsn, unique_name)) < len(payments):
            assert job.poll() is None, f"{run} ended:\n{output(job)}"
            assert time.monotonic() < deadline, f"{run}: {len(table_ids(postgres_dsn, unique_name))} rows\n{output(job)}"
            time.sleep(1)
        get(f"http://127.0.0.1:{ui_port}/", "<title>oncekit status")
        get(f"http://127.0.0.1:{ui_port}/metrics", 'oncekit_last_completed_batch{query="payments"}')

        for doctor in [*console_commands("quickstart-doctor", {"--topic payments": f"--topic {topic}"}),
                       *console_commands("deploy-doctor", {"kafka:9092": kafka.bootstrap_servers,
                                                           "--topic payments": f"--topic {topic}",
                                                           "s3a://bucket/checkpoints": str(checkpoints)})]:
            assert "FAIL" not in sh(doctor, tmp_path, env).stdout

        serve, once = console_commands("status", {"s3a://bucket/checkpoints": str(checkpoints),
                                                  "--port 8765": f"--port {status_port}",
                                                  "/tmp/oncekit-quickstart": str(checkpoints)})
        status = subprocess.Popen(["bash", "-c", f"exec {serve}"], cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            get(f"http://127.0.0.1:{status_port}/metrics", 'oncekit_last_completed_batch{query="payments"}')
        finally:
            os.killpg(status.pid, signal.SIGTERM)
            status.wait(30)
        assert 'oncekit_last_completed_batch{query="payments"}' in sh(once, tmp_path, env).stdout

        create, listed, restore, delete = console_commands(
            "savepoints", {"s3a://bucket/checkpoints-v2": str(tmp_path / "checkpoints-v2"),
                           "s3a://bucket/checkpoints": str(checkpoints)})
        sh(create, tmp_path, env)
        assert job.wait(120) == 0, output(job)
        assert "before-upgrade" in sh(listed, tmp_path, env).stdout
        sh(restore, tmp_path, env)
        assert (tmp_path / "checkpoints-v2" / "payments").is_dir()
        sh(delete, tmp_path, env)
        assert "before-upgrade" not in sh(listed, tmp_path, env).stdout
    finally:
        output(job)
    verdict = compare(payments, table_ids(postgres_dsn, unique_name))
    assert verdict.exactly_once, verdict.summary()

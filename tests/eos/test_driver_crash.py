"""Crashes of the user's driver process itself, where the checkpoint-complete listener runs:
the process dies after Spark logged the last batch as committed, before (or while) its output
is committed. The restarted query must commit it, once."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from oncekit.connectors import KafkaConfig, Services
from oncekit.connectors.kafka import create_topic
from oncekit.core.crash import CRASH_EXIT_CODE, arm, fired
from oncekit.verify import compare
from tests.eos.pipeline import COUNT, prepared_transactions, produce_input, read_committed, table_ids

pytestmark = [pytest.mark.services, pytest.mark.spark]

ROOT = Path(__file__).resolve().parents[2]
LAST_BATCH = 3


def run_driver(services: Services, kind: str, protocol: str, topic: str, target: str, checkpoint: Path) -> int:
    env = {**os.environ, "ONCEKIT_TEST_DSN": services.postgres.dsn}
    return subprocess.run(
        [sys.executable, "-m", "tests.eos.driver", kind, protocol, services.kafka.bootstrap_servers, topic, target,
         str(checkpoint)],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600, check=False,
    ).returncode


@pytest.mark.parametrize(("kind", "protocol"), [("postgres", "two-phase-commit"), ("postgres", "write-ahead-log"),
                                                ("kafka", "write-ahead-log")])
@pytest.mark.parametrize("point", ["before_notify", "mid_commit"])
def test_driver_process_dies_before_last_commit_restart_commits_it_once(
    services: Services, kafka: KafkaConfig, topic: str, unique_name: str, tmp_path: Path, crash_dir: Path,
    kind: str, protocol: str, point: str,
) -> None:
    expected = produce_input(kafka, topic, COUNT)
    if kind == "postgres":
        target = unique_name
        with psycopg.connect(services.postgres.dsn, autocommit=True) as conn:
            conn.execute(f"CREATE TABLE {target} (id int NOT NULL, payload text NOT NULL)")
    else:
        target = f"{topic}-out"
        create_topic(kafka, target, partitions=2)
    arm(crash_dir, point, batch_id=LAST_BATCH)

    assert run_driver(services, kind, protocol, topic, target, tmp_path) == CRASH_EXIT_CODE
    assert fired(crash_dir) == [point]
    assert run_driver(services, kind, protocol, topic, target, tmp_path) == 0

    if kind == "postgres":
        actual = table_ids(services.postgres.dsn, target)
        assert prepared_transactions(services.postgres.dsn) == []
    else:
        actual = [int(v) for v in read_committed(kafka, target, COUNT, timeout_s=60)]
    verdict = compare(expected, actual)
    assert verdict.exactly_once, verdict.summary()

"""Queries started from a Spark Connect client (issue 22), against a real Connect server started
from the pyspark wheel, a real broker and a real PostgreSQL server.

The driver program under test is a Connect client (``python -m oncekit.verify`` with
``SPARK_REMOTE``); its query runs in the server's driver. Killing the client leaves the query
running there: its checkpoint-complete commits must go on without it, within one trigger
(read from the journal and Spark's commit log), and nothing may stay prepared once the input
pauses. A client started again attaches by restarting the query from its checkpoint. Killing
the server (kill -9) then ends the query; the client's restart strategy must bring it back once
the server is up again, exactly once. One story in one test: a Connect server and a client
start take a minute on two busy cores.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from oncekit.connectors import KafkaConfig, Services
from oncekit.connectors.services.spark_connect import ConnectServer
from oncekit.core.crash import CRASH_DIR_ENV
from oncekit.core.engine import CheckpointEngine
from oncekit.core.journal import Journal
from oncekit.core.spark.committer import SWEEP_S
from oncekit.core.spark.query import Trigger
from oncekit.core.spark_log import SparkLog
from oncekit.verify import (
    PipelineContext,
    committed_output,
    compare,
    prepare_target,
    prepared_transactions,
    produce_input,
)
from oncekit.verify.driver import start_driver
from oncekit.verify.examples import example_sink

pytestmark = [pytest.mark.services, pytest.mark.spark]

PIPELINE = "postgres-two-phase-commit"
CHUNK = 3_000
TRIGGER = Trigger(processing_time="1 second")
PER_TRIGGER = 300


@pytest.fixture
def connect_server(tmp_path: Path, crash_dir: Path) -> Iterator[ConnectServer]:
    server = ConnectServer(tmp_path / "connect", env={CRASH_DIR_ENV: str(crash_dir)})
    server.start()
    yield server
    server.kill()


class Client:
    """The pipeline's driver program as a Connect client process."""

    def __init__(self, server: ConnectServer, ctx: PipelineContext, crash_dir: Path, log: Path) -> None:
        self.server, self.ctx, self.crash_dir, self.log = server, ctx, crash_dir, log
        self.process = start_driver(PIPELINE, ctx, str(crash_dir), log=log, env={"SPARK_REMOTE": server.url})

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def alive(self) -> bool:
        return self.process.poll() is None

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


def wait_for_batch(spark_log: SparkLog, batch: int, client: Client, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while max(spark_log.completed(), default=-1) < batch:
        assert client.alive(), f"the client exited: {client.tail()}"
        assert time.monotonic() < deadline, f"batch {batch} not committed by Spark within {timeout_s} s: {client.tail()}"
        time.sleep(0.2)


def setup(services: Services, kafka: KafkaConfig, topic: str, unique_name: str, tmp_path: Path) -> PipelineContext:
    prepare_target(PIPELINE, kafka, services.postgres.dsn, unique_name)
    return PipelineContext(kafka.bootstrap_servers, topic, unique_name, str(tmp_path / "checkpoint"),
                           services.postgres.dsn, trigger=TRIGGER, max_offsets_per_trigger=PER_TRIGGER)


@pytest.mark.long(120)
def test_client_killed_server_commits_within_one_trigger_a_new_client_attaches_and_survives_a_server_kill(
    services: Services, kafka: KafkaConfig, topic: str, unique_name: str, tmp_path: Path, crash_dir: Path,
    connect_server: ConnectServer,
) -> None:
    ctx = setup(services, kafka, topic, unique_name, tmp_path)
    expected = produce_input(kafka, topic, CHUNK)
    spark_log = SparkLog(ctx.checkpoint)
    client = Client(connect_server, ctx, crash_dir, tmp_path / "client-1.log")
    try:
        wait_for_batch(spark_log, 2, client)
        client.kill()
        expected += produce_input(kafka, topic, CHUNK, first=CHUNK)
        journal = Journal(ctx.checkpoint, next(p.name for p in (Path(ctx.checkpoint) / "oncekit").iterdir() if p.is_dir()))
        # Without a client, every batch Spark logged is committed before Spark logs the next:
        # a completed batch other than the newest one that is still uncommitted is a lag of more
        # than one trigger. Spark's commit log is read first, the journal second.
        deadline, late, seen = time.monotonic() + 180, set(), 0
        while True:
            latest = max(spark_log.completed(), default=-1)
            journaled, done = journal.entries()
            uncommitted = {b for b in journaled - done if b <= latest}
            late |= {b for b in uncommitted if b < latest}
            seen = max(seen, latest)
            if len(table_rows(ctx)) >= len(expected):
                break
            assert time.monotonic() < deadline, f"output stopped at {len(table_rows(ctx))} of {len(expected)} rows"
            time.sleep(0.1)
        assert not late, f"batches {sorted(late)} stayed uncommitted after Spark logged a later batch"
        assert seen >= 2 * CHUNK // PER_TRIGGER - 1, f"Spark logged only {seen + 1} batches"
        # The input has paused: the last batch is committed too, and nothing stays prepared.
        settled_by_the_committer(services, ctx, spark_log, journal, connect_server)
        verdict = compare(expected, table_rows(ctx))
        assert verdict.exactly_once, verdict.summary()

        # A client started again attaches: it restarts the query from its checkpoint.
        client = Client(connect_server, ctx, crash_dir, tmp_path / "client-2.log")
        expected += produce_input(kafka, topic, CHUNK, first=2 * CHUNK)
        wait_until_all(ctx, expected, client)

        # The server killed -9 and started again: the client's restart strategy brings the query
        # back on a new session (the client stops the one whose server went away).
        connect_server.kill()
        connect_server.start()
        expected += produce_input(kafka, topic, CHUNK, first=3 * CHUNK)
        wait_until_all(ctx, expected, client)
    finally:
        client.kill()
    # The last batch can be in flight when the client goes: the input's aborted records and its
    # transaction markers move the offsets on after the last visible row (seen in clean-clone
    # runs: batch 42, planned after the last row was visible, once still prepared 30 s after the
    # client went, in a CI run that did not record whether Spark or the committer was slow).
    # Spark finishing that batch is Spark's pace; the kit's part is what follows: once Spark
    # logged every planned batch complete, the server's committer, without a client, commits
    # them within a few sweeps.
    settled_by_the_committer(services, ctx, spark_log, journal, connect_server)
    verdict = compare(expected, table_rows(ctx))
    assert verdict.exactly_once, verdict.summary()
    # Without a client the server runs the query on, and may prepare a batch the input's markers
    # planned after the check above (seen in a clean-clone run: batch 42 left prepared when the
    # server was stopped, in every later test's way). The server killed, the next run's start
    # settles what it left, as it would in production: still exactly-once, nothing prepared.
    connect_server.kill()
    CheckpointEngine.of(example_sink(PIPELINE, kafka, services.postgres.dsn, unique_name), ctx.checkpoint).start_run(
        "the-next-run")
    assert prepared_transactions(services.postgres.dsn, unique_name) == []
    verdict = compare(expected, table_rows(ctx))
    assert verdict.exactly_once, verdict.summary()


def settled_by_the_committer(services: Services, ctx: PipelineContext, spark_log: SparkLog, journal: Journal,
                             server: ConnectServer, spark_s: float = 180, committer_s: float = 3 * SWEEP_S) -> None:
    """Wait for Spark to log every planned batch complete, then for the server's committer to
    commit them all; fail naming where it stopped."""
    def state() -> str:
        journaled, done = journal.entries()
        return (f"Spark planned {spark_log.latest_planned()}, completed {spark_log.latest_completed()}; journaled "
                f"{sorted(journaled)[-3:]}, done {sorted(done)[-3:]}; prepared "
                f"{prepared_transactions(services.postgres.dsn, ctx.output)}; the server's log:\n" + "\n".join(
                    [line for line in server.log.read_text(errors="replace").splitlines()
                     if "oncekit" in line or "WriteToDataSourceV2Exec" in line or " ERROR " in line][-30:]))

    deadline = time.monotonic() + spark_s
    while spark_log.latest_planned() != spark_log.latest_completed():
        assert time.monotonic() < deadline, f"Spark did not finish its last batch within {spark_s:.0f} s: {state()}"
        time.sleep(0.5)
    deadline = time.monotonic() + committer_s
    while prepared_transactions(services.postgres.dsn, ctx.output):
        assert time.monotonic() < deadline, \
            f"the committer left batches prepared {committer_s:.0f} s after Spark completed them: {state()}"
        time.sleep(0.5)


def table_rows(ctx: PipelineContext) -> list[int]:
    return committed_output(PIPELINE, ctx.kafka, ctx.dsn, ctx.output, 0)


def wait_until_all(ctx: PipelineContext, expected: list[int], client: Client, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while len(table_rows(ctx)) < len(expected):
        assert client.alive(), f"the client exited: {client.tail()}"
        assert time.monotonic() < deadline, \
            f"output stopped at {len(table_rows(ctx))} of {len(expected)} rows within {timeout_s} s: {client.tail()}"
        time.sleep(0.5)


def test_a_server_whose_python_has_no_oncekit_is_named_at_start(
    services: Services, kafka: KafkaConfig, topic: str, unique_name: str, tmp_path: Path,
) -> None:
    """Install checks: the server's workers run a Python whose site hooks are off, so pyspark and
    the clients import (on PYTHONPATH) but the kit does not; the client's start fails with a
    ConfigError that says what to install where, not a worker's traceback. The client runs in a
    process of its own (a Connect session changes pyspark's process-wide mode)."""
    bare = tmp_path / "python-without-oncekit"
    bare.write_text("#!/bin/sh\n"
                    f'PYTHONPATH="{sysconfig.get_paths()["purelib"]}${{PYTHONPATH:+:$PYTHONPATH}}" '
                    f'exec {sys.executable} -S "$@"\n')
    bare.chmod(0o755)
    server = ConnectServer(tmp_path / "connect", env={"PYSPARK_PYTHON": str(bare)})
    server.start()
    ctx = setup(services, kafka, topic, unique_name, tmp_path)
    client = (
        "import dataclasses, json, sys\n"
        "from oncekit.core.spark.session import spark_session\n"
        "from oncekit.verify import PipelineContext, start_example\n"
        "spark = spark_session('no-kit-on-the-server')\n"
        "try:\n"
        "    start_example(sys.argv[1], spark, PipelineContext.from_dict(json.loads(sys.argv[2])))\n"
        "except Exception as exc:\n"
        "    print(type(exc).__name__, str(exc).splitlines()[0])\n"
        "spark.stop()\n"
    )
    try:
        done = subprocess.run([sys.executable, "-c", client, PIPELINE, json.dumps(dataclasses.asdict(ctx))],
                              env={**os.environ, "SPARK_REMOTE": server.url}, capture_output=True, text=True, timeout=180)
    finally:
        server.kill()
    error = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-2000:]
    assert re.match(r"ConfigError sink \S+: the Python that runs the query's Spark workers has no oncekit; install "
                    r"oncekit==[\d.]+ .*PYSPARK_PYTHON", error), error

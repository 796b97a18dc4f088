"""A standby driver and a driver that lost its lease (issue 23 item 3), against a real broker:
the standby campaign (kills of the active driver, of the standby, of both, and an active driver
paused past its lease's expiry) ends exactly once with progress after every fault; a driver whose
lease another run took stops its query and journals nothing more."""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from oncekit.connectors import KafkaConfig
from oncekit.connectors.kafka import create_topic
from oncekit.core.crash import arm, fired, fired_at, release
from oncekit.core.lease import EXPIRY_ENV, LEASE
from oncekit.core.spark_log import SparkLog
from oncekit.verify import PipelineContext, compare, start_example
from oncekit.verify.driver import DriverProcess, Timeline
from oncekit.verify.examples import sink_kind
from oncekit.verify.io import KafkaOutput, PipelineOutput, prepare_target, prepared_transactions, table_ids
from tests.eos.pipeline import COUNT, produce_input, read_committed

pytestmark = [pytest.mark.services, pytest.mark.spark]


def output_values(kafka: KafkaConfig, topic: str, expected: int) -> list[int]:
    return [int(v) for v in read_committed(kafka, topic, expected, timeout_s=60)]


CHUNK = 1_000
PROGRESS_S = 120.0
"""Every step's input is committed within this many seconds, else the campaign stalled."""
LEASE_EXPIRY_S = 15.0
LIVE_LEASE_S = LEASE_EXPIRY_S * 3 / 4
"""A paused driver's lease stays live at least this long: its last renewal came at most
expiry / 4 (the renewal period) before the pause."""


def progress(kafka: KafkaConfig, topic: str, expected: list[int], output: KafkaOutput, after: str, logs: Path) -> None:
    """More input (appended to ``expected``); all of it so far committed within PROGRESS_S, else a
    stall named by step."""
    expected.extend(produce_input(kafka, topic, CHUNK, first=len(expected)))
    deadline = time.monotonic() + PROGRESS_S
    while len(output.read()) < len(expected):
        if time.monotonic() > deadline:
            raise AssertionError(f"stall after {after}: {len(output.read())} of {len(expected)} records committed "
                                 f"after {PROGRESS_S:.0f} s; driver logs in {logs}")
        time.sleep(0.5)


def wait_for_rows(dsn: str, table: str, expected: list[int], after: str, logs: Path) -> None:
    """All of ``expected`` in ``table`` within PROGRESS_S, else a stall named by step."""
    deadline = time.monotonic() + PROGRESS_S
    while len(table_ids(dsn, table)) < len(expected):
        if time.monotonic() > deadline:
            raise AssertionError(f"stall after {after}: {len(table_ids(dsn, table))} of {len(expected)} rows "
                                 f"committed after {PROGRESS_S:.0f} s; logs in {logs}")
        time.sleep(0.5)


def postgres_drivers(kafka: KafkaConfig, dsn: str, topic: str, table: str, tmp_path: Path, crash_dir: Path,
                     pipeline: str, env: dict[str, str]) -> tuple[DriverProcess, DriverProcess]:
    """An active and a standby driver of ``pipeline`` into a fresh PostgreSQL table."""
    prepare_target(pipeline, kafka, dsn, table)
    ctx = PipelineContext(kafka.bootstrap_servers, topic, table, str(tmp_path / "checkpoint"), dsn=dsn,
                          trigger={"processingTime": "1 second"}, max_offsets_per_trigger=500)
    return (DriverProcess(pipeline, ctx, str(crash_dir), tmp_path / "active.log", env),
            DriverProcess(pipeline, ctx, str(crash_dir), tmp_path / "standby.log", env, standby=True))


STANDBY_PIPELINES = ["kafka-transactional", "kafka-write-ahead-log", "postgres-two-phase-commit",
                     "postgres-write-ahead-log", "fan-out-postgres-kafka-wal"]
"""Every protocol: Kafka transactional and write-ahead log, PostgreSQL two-phase commit and
write-ahead log, and one query fanned out into a table (two-phase commit) and a topic
(write-ahead log)."""


@pytest.mark.parametrize("pipeline", STANDBY_PIPELINES)
def test_standby_campaign_ends_exactly_once_with_progress_after_every_fault(
    kafka: KafkaConfig, postgres_dsn: str, topic: str, unique_name: str, tmp_path: Path, crash_dir: Path,
    pipeline: str,
) -> None:
    """Kill -9 of the standby, of the active driver, of both one after the other, and an active
    driver paused (SIGSTOP) past its lease's expiry, which must stop without writing once it
    resumes: after each, all input so far is committed within PROGRESS_S; at the end, the output
    is the input, exactly once, with nothing prepared, no transaction open and nothing staged."""
    out = unique_name
    prepare_target(pipeline, kafka, postgres_dsn, out)
    ctx = PipelineContext(kafka.bootstrap_servers, topic, out, str(tmp_path / "checkpoint"), dsn=postgres_dsn,
                          trigger={"processingTime": "1 second"}, max_offsets_per_trigger=500)
    env = {EXPIRY_ENV: str(LEASE_EXPIRY_S)}
    drivers: list[DriverProcess] = []
    expected: list[int] = []
    output = PipelineOutput(sink_kind(pipeline), kafka, postgres_dsn, out)

    def driver(standby: bool) -> DriverProcess:
        started = DriverProcess(pipeline, ctx, str(crash_dir), tmp_path / f"driver{len(drivers)}.log", env,
                                standby=standby)
        drivers.append(started)
        started.ensure_running()
        if not standby:  # its query holds the lease before a standby is started beside it
            started.wait_step("query", PROGRESS_S)
        return started

    def step(after: str) -> None:
        """More input; all of it so far committed within PROGRESS_S, else a stall named by step."""
        expected.extend(produce_input(kafka, topic, CHUNK, first=len(expected)))
        want = Counter(output.wanted(expected))
        deadline = time.monotonic() + PROGRESS_S
        while want - Counter(output.read()):
            if time.monotonic() > deadline:
                raise AssertionError(f"{pipeline}: stall after {after}: {sum((want - Counter(output.read())).values())} "
                                     f"records missing after {PROGRESS_S:.0f} s; driver logs in {tmp_path}")
            time.sleep(0.5)

    try:
        # Each new standby warms up while the step after its start runs.
        active, standby = driver(False), driver(True)
        step("the start")
        standby.wait_step("warm", PROGRESS_S)
        standby.kill()
        standby = driver(True)
        step("kill -9 of the standby")
        standby.wait_step("warm", PROGRESS_S)
        active.kill()
        active, standby = standby, driver(True)
        step("kill -9 of the active driver (the standby took over)")
        standby.wait_step("warm", PROGRESS_S)
        active.kill()
        standby.kill()
        active, standby = driver(False), driver(True)  # a supervisor starts both again
        step("kill -9 of the active driver and then of the standby")
        standby.wait_step("warm", PROGRESS_S)
        active.pause()
        paused = time.monotonic()
        step("the active driver paused past its lease's expiry (the standby took over)")
        assert time.monotonic() - paused > LIVE_LEASE_S, "the standby took over from a live lease"
        active.resume()
        assert active.process is not None
        active.process.wait(timeout=60)  # it found its lease taken and stopped: LeaseLostError
        assert "lease is held by another driver" in active.log.read_text()
        step("the paused driver resumed and stopped")
        for running in drivers:
            running.stop()
        time.sleep(1.0)  # late duplicates would show
        verdict = compare(output.wanted(expected), output.read())
        assert verdict.exactly_once, verdict.summary()
        assert output.left_open(ctx.checkpoint) == []
    finally:
        for running in drivers:
            running.kill()
        output.close()


def test_a_transient_query_failure_with_a_standby_waiting_restarts_in_place(
    kafka: KafkaConfig, topic: str, tmp_path: Path, crash_dir: Path,
) -> None:
    """One task of the active driver dies once, and Spark does not retry it (``local[2]`` gives a
    task one attempt), so the query fails: its restart strategy restarts it in place, the waiting
    standby keeps waiting (the lease is kept through the restart), and the output is exactly once."""
    out = f"{topic}-out"
    create_topic(kafka, out, partitions=2)
    ctx = PipelineContext(kafka.bootstrap_servers, topic, out, str(tmp_path / "checkpoint"),
                          trigger={"processingTime": "1 second"}, max_offsets_per_trigger=500)
    env = {EXPIRY_ENV: str(LEASE_EXPIRY_S), "SPARK_MASTER": "local[2]"}
    active = DriverProcess("kafka-transactional", ctx, str(crash_dir), tmp_path / "active.log", env)
    standby = DriverProcess("kafka-transactional", ctx, str(crash_dir), tmp_path / "standby.log", env, standby=True)
    expected: list[int] = []

    def step(after: str, output: KafkaOutput) -> None:
        progress(kafka, topic, expected, output, after, tmp_path)

    try:
        with KafkaOutput(kafka, out) as output:
            active.ensure_running()
            active.wait_step("query", PROGRESS_S)
            standby.ensure_running()
            standby.wait_step("warm", PROGRESS_S)
            step("the start", output)
            arm(crash_dir, "task_before_write")
            step("a task's worker died once", output)
            assert fired(crash_dir) == ["task_before_write"]
            restarts = Path(ctx.checkpoint + ".restarts").read_text().splitlines()
            assert len(restarts) == 1, f"the active driver restarted its query {len(restarts)} times: {restarts}"
            assert active.process is not None and active.process.poll() is None, "the active driver ended"
            took_over = [e for e in Timeline(ctx.checkpoint).read() if e["step"] == "takeover"]
            assert not took_over, "the standby took over from a driver that only restarted its query"
            step("the restart in place", output)
        active.stop()
    finally:
        active.kill()
        standby.kill()
    verdict = compare(expected, output_values(kafka, out, len(expected)))
    assert verdict.exactly_once, verdict.summary()


def test_a_driver_whose_lease_another_run_took_stops_and_journals_nothing_more(
    spark: Any, kafka: KafkaConfig, topic: str, tmp_path: Path,
) -> None:
    produce_input(kafka, topic, COUNT)
    out = f"{topic}-out"
    create_topic(kafka, out, partitions=2)
    ctx = PipelineContext(kafka.bootstrap_servers, topic, out, str(tmp_path / "checkpoint"),
                          trigger={"processingTime": "1 second"}, max_offsets_per_trigger=50)
    query = start_example("kafka-transactional", spark, ctx)
    spark_log = SparkLog(ctx.checkpoint)
    deadline = time.monotonic() + 120
    def committed() -> int:
        latest = spark_log.latest_completed()
        return -1 if latest is None else latest

    while committed() < 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert committed() >= 1, "the query committed no batch"
    # A standby on another host takes the lease over, as if this driver had been paused past its expiry.
    (Path(ctx.checkpoint) / LEASE).write_text(json.dumps(
        {"host": "standby-host", "pid": 1, "process": "standby", "renewed_at": time.time() + 60, "run": "standby"}))
    taken = committed()
    with pytest.raises(Exception, match="lease is held by another driver"):
        query.await_termination(60)
        raise AssertionError("the query went on after losing its lease")
    assert committed() <= taken + 1  # at most the batch in flight at the takeover


def test_a_second_driver_in_another_pid_namespace_with_the_same_host_name_does_not_run_beside_the_first(
    kafka: KafkaConfig, topic: str, tmp_path: Path, crash_dir: Path,
) -> None:
    """Containers that share the host's name (host networking) and cloned machines: a driver
    started on the checkpoint from another pid namespace cannot see the active driver's pid, and
    must not take that for "the holder is gone". It is refused while the active driver runs, the
    active driver goes on, and the output is exactly once."""
    out = f"{topic}-out"
    create_topic(kafka, out, partitions=2)
    ctx = PipelineContext(kafka.bootstrap_servers, topic, out, str(tmp_path / "checkpoint"),
                          trigger={"processingTime": "1 second"}, max_offsets_per_trigger=500)
    env = {EXPIRY_ENV: str(LEASE_EXPIRY_S)}
    active = DriverProcess("kafka-transactional", ctx, str(crash_dir), tmp_path / "active.log", env)
    other = DriverProcess("kafka-transactional", ctx, str(crash_dir), tmp_path / "other.log", env,
                          prefix=("unshare", "--pid", "--fork", "--mount-proc"))
    expected: list[int] = []
    try:
        with KafkaOutput(kafka, out) as output:
            active.ensure_running()
            active.wait_step("query", PROGRESS_S)
            progress(kafka, topic, expected, output, "the start", tmp_path)
            other.ensure_running()
            deadline = time.monotonic() + PROGRESS_S
            while not (other.log.exists() and "is running" in other.log.read_text()):
                assert time.monotonic() < deadline, f"the second driver was not refused; see {other.log}"
                time.sleep(0.5)
            progress(kafka, topic, expected, output, "a second driver refused from another pid namespace", tmp_path)
            assert active.process is not None and active.process.poll() is None, "the active driver ended"
            assert "lease is held by another driver" not in active.log.read_text()
        active.stop()
    finally:
        active.kill()
        other.kill()
    verdict = compare(expected, output_values(kafka, out, len(expected)))
    assert verdict.exactly_once, verdict.summary()


@pytest.mark.parametrize("pipeline", ["postgres-two-phase-commit"])
def test_an_active_driver_paused_in_its_driver_commit_past_a_takeover_changes_nothing_when_it_wakes(
    kafka: KafkaConfig, postgres_dsn: str, topic: str, unique_name: str, tmp_path: Path, crash_dir: Path,
    pipeline: str,
) -> None:
    """The active driver journals a batch and is paused right there, in its driver commit (before
    Spark logs the batch), past its lease's expiry: the standby takes over, aborts what the batch
    left and replays it. Then the paused driver wakes, its driver commit goes on, and its
    listener commits: fenced, nothing of it changes the output. It stops, the standby goes on,
    and the table is the input exactly once, nothing prepared."""
    active, standby = postgres_drivers(kafka, postgres_dsn, topic, unique_name, tmp_path, crash_dir, pipeline,
                                       {EXPIRY_ENV: str(LEASE_EXPIRY_S)})
    expected: list[int] = []

    def step(after: str) -> None:
        expected.extend(produce_input(kafka, topic, CHUNK, first=len(expected)))
        wait_for_rows(postgres_dsn, unique_name, expected, after, tmp_path)

    try:
        active.ensure_running()
        active.wait_step("query", PROGRESS_S)
        standby.ensure_running()
        standby.wait_step("warm", PROGRESS_S)
        step("the start")
        arm(crash_dir, "driver_after_journal", hold=True)
        expected.extend(produce_input(kafka, topic, CHUNK, first=len(expected)))
        deadline = time.monotonic() + PROGRESS_S
        while fired_at(crash_dir, "driver_after_journal") is None:
            assert time.monotonic() < deadline, f"the active driver never reached its driver commit; see {active.log}"
            time.sleep(0.2)
        active.pause()
        paused = time.monotonic()
        wait_for_rows(postgres_dsn, unique_name, expected, "the active driver paused in its driver commit", tmp_path)
        assert time.monotonic() - paused > LIVE_LEASE_S, "the standby took over from a live lease"
        active.resume()
        release(crash_dir, "driver_after_journal")
        assert active.process is not None
        active.process.wait(timeout=120)  # it found its lease taken, or its run fenced, and stopped
        step("the paused driver woke and stopped")
        standby.stop()
    finally:
        release(crash_dir, "driver_after_journal")
        active.kill()
        standby.kill()
    verdict = compare(expected, table_ids(postgres_dsn, unique_name))
    assert verdict.exactly_once, verdict.summary()
    assert prepared_transactions(postgres_dsn, unique_name) == []


def test_an_active_driver_paused_in_its_abort_past_a_takeover_leaves_the_standbys_replay_alone(
    kafka: KafkaConfig, postgres_dsn: str, topic: str, unique_name: str, tmp_path: Path, crash_dir: Path,
) -> None:
    """A task of the active driver fails (``local[2]``: no retry), so Spark aborts the batch on the
    driver; the driver is paused right there, past its lease's expiry. The standby takes over and
    replays the batch, and is held once it has journaled it (its transactions prepared). Then the
    paused driver wakes and its abort goes on: it must abort only its own run's transactions,
    never the standby's, which the standby then commits. The table is the input exactly once,
    nothing prepared (PostgreSQL two-phase commit)."""
    pipeline = "postgres-two-phase-commit"
    active, standby = postgres_drivers(kafka, postgres_dsn, topic, unique_name, tmp_path, crash_dir, pipeline,
                                       {EXPIRY_ENV: str(LEASE_EXPIRY_S), "SPARK_MASTER": "local[2]"})
    expected: list[int] = []

    def wait_for(point: str, driver: DriverProcess) -> None:
        deadline = time.monotonic() + PROGRESS_S
        while fired_at(crash_dir, point) is None:
            assert time.monotonic() < deadline, f"{point} never reached; see {driver.log}"
            time.sleep(0.2)

    try:
        active.ensure_running()
        active.wait_step("query", PROGRESS_S)
        standby.ensure_running()
        standby.wait_step("warm", PROGRESS_S)
        expected.extend(produce_input(kafka, topic, CHUNK, first=len(expected)))
        wait_for_rows(postgres_dsn, unique_name, expected, "the start", tmp_path)
        arm(crash_dir, "task_before_write")
        arm(crash_dir, "driver_abort", hold=True)
        expected.extend(produce_input(kafka, topic, CHUNK, first=len(expected)))
        wait_for("driver_abort", active)
        active.pause()
        arm(crash_dir, "driver_after_journal", hold=True)  # the standby's replay, journaled and prepared
        wait_for("driver_after_journal", standby)
        active.resume()
        release(crash_dir, "driver_abort")
        assert active.process is not None
        active.process.wait(timeout=120)  # its abort went on, then it found its lease taken and stopped
        release(crash_dir, "driver_after_journal")
        wait_for_rows(postgres_dsn, unique_name, expected, "the paused driver's abort went on", tmp_path)
        expected.extend(produce_input(kafka, topic, CHUNK, first=len(expected)))
        wait_for_rows(postgres_dsn, unique_name, expected, "more input after the takeover", tmp_path)
        standby.stop()
    finally:
        for point in ("driver_abort", "driver_after_journal"):
            release(crash_dir, point)
        active.kill()
        standby.kill()
    verdict = compare(expected, table_ids(postgres_dsn, unique_name))
    assert verdict.exactly_once, verdict.summary()
    assert prepared_transactions(postgres_dsn, unique_name) == []

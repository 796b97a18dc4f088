"""Failover with a standby driver, fenced at the sinks (issue 33), against real Kafka, PostgreSQL
and Spark: an active driver paused past its lease's expiry in its driver commit and in its abort
is taken over and changes nothing; with two warm standbys exactly one takes over after each kill
of the active driver; a standby keeps waiting through a restart in place and takes over after
every kill (``make test-long``); a driver whose lease another run took, or whose sink a newer run
took at the target, stops; a second driver from another pid namespace with the same host name is
refused. The simulation (tests/sim) explores the interleavings of all of these on every protocol;
these are their real-service part.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from oncekit.connectors import KafkaConfig
from oncekit.connectors.kafka_admin import create_topic
from oncekit.core.crash import arm, fired, fired_at, release
from oncekit.core.engine import CheckpointEngine
from oncekit.core.errors import FencedError
from oncekit.core.lease import EXPIRY_ENV, LEASE
from oncekit.core.spark.query import Trigger
from oncekit.core.spark_log import SparkLog
from oncekit.verify import PipelineContext, compare, start_example
from oncekit.verify.driver import DriverProcess, Timeline
from oncekit.verify.examples import sink_kind
from oncekit.verify.io import KafkaOutput, PipelineOutput, prepare_target
from tests.eos.pipeline import COUNT, drawn, produce_input, read_committed
from tests.sizes import full_size

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


STANDBY_PIPELINES = ["kafka-transactional", "postgres-write-ahead-log", "fan-out-postgres-kafka-wal"]
"""Every protocol in three runs: Kafka transactional, PostgreSQL write-ahead log, and one query
fanned out into a table by two-phase commit and a topic by write-ahead log (each target judged
on its own). A run of its own for PostgreSQL two-phase commit and Kafka write-ahead log passed
as well (1 run each, 246 s and 265 s in a full suite) and cost the suite four minutes."""
DRAWN = drawn(STANDBY_PIPELINES, "ONCEKIT_STANDBY_RUNS")
"""The pipelines the single-standby campaigns take (``make test``: 1; ``make test-long``: all 3)."""


class Failover:
    """A standby campaign's query on ``pipeline``: its drivers, its input so far and its output,
    and what every campaign does between two faults. ``close`` kills what still runs."""

    def __init__(self, pipeline: str, kafka: KafkaConfig, postgres_dsn: str, topic: str, out: str, logs: Path,
                 crash_dir: Path, expiry_s: float) -> None:
        prepare_target(pipeline, kafka, postgres_dsn, out)
        self.pipeline, self.kafka, self.topic, self.logs, self.crash_dir = pipeline, kafka, topic, logs, crash_dir
        self.ctx = PipelineContext(kafka.bootstrap_servers, topic, out, str(logs / "checkpoint"), dsn=postgres_dsn,
                                   trigger=Trigger(processing_time="1 second"), max_offsets_per_trigger=500)
        self.env = {EXPIRY_ENV: str(expiry_s), "SPARK_MASTER": "local[2]"}
        self.drivers: list[DriverProcess] = []
        self.expected: list[int] = []
        self.output = PipelineOutput(sink_kind(pipeline), kafka, postgres_dsn, out)

    def driver(self, standby: bool) -> DriverProcess:
        """A driver process started on the query (as a standby: warming up, waiting)."""
        started = DriverProcess(self.pipeline, self.ctx, str(self.crash_dir), self.logs / f"driver{len(self.drivers)}.log",
                                self.env, standby=standby)
        self.drivers.append(started)
        started.ensure_running()
        if not standby:  # its query holds the lease before a standby is started beside it
            started.wait_step("query", PROGRESS_S)
        return started

    def started(self) -> tuple[DriverProcess, DriverProcess]:
        """An active driver and a warm standby, the input so far committed: (active, standby)."""
        active, standby = self.driver(False), self.driver(True)
        self.step("the start")
        standby.wait_step("warm", PROGRESS_S)
        return active, standby

    def more_input(self) -> None:
        self.expected.extend(produce_input(self.kafka, self.topic, CHUNK, first=len(self.expected)))

    def caught_up(self, after: str) -> None:
        """All input so far committed within PROGRESS_S, else a stall named by step."""
        want = Counter(self.output.wanted(self.expected))
        deadline = time.monotonic() + PROGRESS_S
        while missing := want - Counter(self.output.read()):
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.pipeline}: stall after {after}: {sum(missing.values())} records missing "
                                     f"after {PROGRESS_S:.0f} s; driver logs in {self.logs}")
            time.sleep(0.5)

    def step(self, after: str) -> None:
        self.more_input()
        self.caught_up(after)

    def reached(self, point: str, by: DriverProcess) -> None:
        """Wait until driver ``by`` reached crash point ``point`` (armed to hold there)."""
        deadline = time.monotonic() + PROGRESS_S
        while fired_at(self.crash_dir, point) is None:
            assert time.monotonic() < deadline, f"{self.pipeline}: {point} never reached; see {by.log}"
            time.sleep(0.2)

    def stood_aside(self, woken: DriverProcess, warm_before: int) -> None:
        """A woken driver whose lease was taken stops its query by itself (LeaseLostError or
        FencedError): one started as the active driver ends; one started as a standby (it took
        over earlier) warms up and waits again, for the next failover."""
        assert woken.process is not None
        if not woken.standby:
            woken.process.wait(timeout=PROGRESS_S)
            return
        deadline = time.monotonic() + PROGRESS_S
        while woken.times_reached("warm") <= warm_before:
            assert woken.process.poll() is None, f"{self.pipeline}: the woken standby ended; see {woken.log}"
            assert time.monotonic() < deadline, f"{self.pipeline}: the woken standby did not wait again; see {woken.log}"
            time.sleep(0.5)

    def finish(self) -> None:
        """Stop every driver; the output is the input exactly once, nothing left open."""
        for running in self.drivers:
            running.stop()
        time.sleep(1.0)  # late duplicates would show
        verdict = compare(self.output.wanted(self.expected), self.output.read())
        assert verdict.exactly_once, verdict.summary()
        assert self.output.left_open(self.ctx.checkpoint) == []

    def close(self) -> None:
        for running in self.drivers:
            running.kill()
        self.output.close()


@pytest.mark.full_size
@pytest.mark.long(200)
@pytest.mark.parametrize("pipeline", DRAWN)
def test_standby_keeps_waiting_through_a_restart_in_place_and_takes_over_after_every_kill(
    kafka: KafkaConfig, postgres_dsn: str, topic: str, unique_name: str, tmp_path: Path, crash_dir: Path,
    pipeline: str,
) -> None:
    """An active driver and a warm standby on one checkpoint, through the kills of a failover:

    - a transient task failure of the active driver (``local[2]``: Spark does not retry the
      task, so the query fails): it restarts in place and the standby keeps waiting;
    - kill -9 of the standby, of the active driver, of both one after the other.

    After each fault all input so far is committed within PROGRESS_S; at the end the output is
    the input exactly once (per target), nothing prepared, no transaction open, nothing staged.
    The simulation explores these interleavings on every protocol in ``make test``; the
    two-standby campaign kills the active driver there on real services."""
    campaign = Failover(pipeline, kafka, postgres_dsn, topic, unique_name, tmp_path, crash_dir, LEASE_EXPIRY_S)
    driver, step = campaign.driver, campaign.step
    restarts = Path(campaign.ctx.checkpoint + ".restarts")
    try:
        # Each new standby warms up while the step after its start runs.
        active, standby = campaign.started()

        arm(crash_dir, "task_before_write")
        step("a transient task failure of the active driver")
        assert fired(crash_dir) == ["task_before_write"]
        assert len(restarts.read_text().splitlines()) == 1, f"restarts: {restarts.read_text()}"
        assert active.process is not None and active.process.poll() is None, "the active driver ended"
        assert not [e for e in Timeline(campaign.ctx.checkpoint).read() if e["step"] == "takeover"], \
            "the standby took over from a driver that only restarted its query"

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
        driver(False)  # a supervisor starts both again
        driver(True)
        step("kill -9 of the active driver and then of the standby")
        campaign.finish()
    finally:
        campaign.close()


@pytest.mark.long(230)
@pytest.mark.parametrize("pipeline", DRAWN)
def test_a_driver_paused_past_its_lease_in_its_commit_is_taken_over_and_changes_nothing(
    kafka: KafkaConfig, postgres_dsn: str, topic: str, unique_name: str, tmp_path: Path, crash_dir: Path,
    pipeline: str,
) -> None:
    """An active driver and a warm standby on one checkpoint; the active driver is paused
    (SIGSTOP of its whole process group: JVM, Python workers, open sessions and transactions)
    past its lease's expiry in the middle of its driver commit (the batch journaled, not yet
    logged by Spark): the standby takes over and replays the batch; woken, the old driver's
    commit goes on, fenced, and it stops.

    After the fault all input so far is committed within PROGRESS_S; at the end the output is
    the input exactly once (per target), nothing prepared, no transaction open, nothing staged.
    The simulation pauses drivers at every step on every protocol; this is its real-service
    part (``make test-long`` also pauses a driver in its abort)."""
    campaign = Failover(pipeline, kafka, postgres_dsn, topic, unique_name, tmp_path, crash_dir, LEASE_EXPIRY_S)
    step = campaign.step
    try:
        active, standby = campaign.started()

        arm(crash_dir, "driver_after_journal", hold=True)
        campaign.more_input()
        campaign.reached("driver_after_journal", active)
        warm_before = active.times_reached("warm")
        active.pause()
        paused = time.monotonic()
        campaign.caught_up("the active driver paused in its driver commit past its lease's expiry")
        assert time.monotonic() - paused > LIVE_LEASE_S, "the standby took over from a live lease"
        active.resume()
        release(crash_dir, "driver_after_journal")
        campaign.stood_aside(active, warm_before)
        step("the driver paused in its commit woke and stood aside")
        campaign.finish()
    finally:
        release(crash_dir, "driver_after_journal")
        campaign.close()


@pytest.mark.full_size
@pytest.mark.long(230)
@pytest.mark.parametrize("pipeline", DRAWN)
def test_a_driver_paused_past_its_lease_in_its_abort_is_taken_over_and_changes_nothing(
    kafka: KafkaConfig, postgres_dsn: str, topic: str, unique_name: str, tmp_path: Path, crash_dir: Path,
    pipeline: str,
) -> None:
    """An active driver and a warm standby on one checkpoint; a task fails, and the active driver
    is paused (SIGSTOP of its process group) past its lease's expiry in the middle of its abort of
    the failed batch, and woken once the standby has journaled its replay: it aborts only its own
    run's work and stops. Then more input; at the end the output is the input exactly once."""
    campaign = Failover(pipeline, kafka, postgres_dsn, topic, unique_name, tmp_path, crash_dir, LEASE_EXPIRY_S)
    step = campaign.step
    try:
        active, standby = campaign.started()

        arm(crash_dir, "task_before_write")
        arm(crash_dir, "driver_abort", hold=True)
        campaign.more_input()
        campaign.reached("driver_abort", active)
        warm_before = active.times_reached("warm")
        active.pause()
        arm(crash_dir, "driver_after_journal", hold=True)  # the standby's replay, journaled
        campaign.reached("driver_after_journal", standby)
        active.resume()
        release(crash_dir, "driver_abort")
        campaign.stood_aside(active, warm_before)
        release(crash_dir, "driver_after_journal")
        campaign.caught_up("the driver paused in its abort woke and stood aside")
        step("more input after the takeover")
        campaign.finish()
    finally:
        for point in ("driver_abort", "driver_after_journal"):
            release(crash_dir, point)
        campaign.close()


TWO_STANDBY_DRAWN = drawn(STANDBY_PIPELINES, "ONCEKIT_TWO_STANDBY_RUNS", salt=1)
"""The pipelines the two-standby campaign takes (``make test``: 1; ``make test-long``: all 3). The
simulation (tests/sim) covers the interleavings of the race between standbys; this is its
real-service part."""
KILLS = 3 if full_size() else 1
"""Kills of the active driver: one in ``make test`` (the simulation explores the race between
standbys after every kill), three in ``make test-long``."""
FAST_EXPIRY_S = 6.0


def lease_holder_pid(checkpoint: str) -> int | None:
    try:
        return int(json.loads((Path(checkpoint) / LEASE).read_text())["pid"])
    except (OSError, ValueError, KeyError):
        return None


@pytest.mark.long(200)
@pytest.mark.parametrize("pipeline", TWO_STANDBY_DRAWN)
def test_with_two_warm_standbys_exactly_one_takes_over_after_each_kill_and_the_other_keeps_waiting(
    kafka: KafkaConfig, postgres_dsn: str, topic: str, unique_name: str, tmp_path: Path, crash_dir: Path,
    pipeline: str,
) -> None:
    """An active driver and two warm standbys on one checkpoint; the active driver is killed (-9)
    (``KILLS`` times). After each kill all input so far is committed within PROGRESS_S, exactly one
    standby holds the query's lease and runs it, and the other is still there, waiting (it may
    have started at the same moment and lost the race: then it waits again). Before the next kill
    a new standby is started, as a supervisor would. At the end the output is exactly once."""
    campaign = Failover(pipeline, kafka, postgres_dsn, topic, unique_name, tmp_path, crash_dir, FAST_EXPIRY_S)
    driver, step, checkpoint = campaign.driver, campaign.step, campaign.ctx.checkpoint
    try:
        active = driver(False)
        standbys = [driver(True), driver(True)]
        step("the start")
        for waiting in standbys:
            waiting.wait_step("warm", PROGRESS_S)
        for kill in range(1, KILLS + 1):
            active.kill()
            step(f"kill -9 of the active driver ({kill} of {KILLS})")
            holder = lease_holder_pid(checkpoint)
            winners = [s for s in standbys if s.process is not None and s.process.pid == holder]
            assert len(winners) == 1, f"{pipeline}: after kill {kill} the lease is held by pid {holder}, not by one " \
                                      f"of the standbys {[s.process.pid for s in standbys if s.process]}; logs in {tmp_path}"
            (loser,) = [s for s in standbys if s is not winners[0]]
            time.sleep(2 * FAST_EXPIRY_S)  # a loser that would give up or take the lease back does so by now
            assert loser.process is not None and loser.process.poll() is None, \
                f"{pipeline}: the standby that did not take over ended (exit {loser.process and loser.process.poll()}); " \
                f"see {loser.log}"
            assert lease_holder_pid(checkpoint) == holder, f"{pipeline}: the lease changed hands after kill {kill}"
            active, standbys = winners[0], [loser]
            if kill < KILLS:  # a supervisor starts a new standby for the next failover
                standbys.append(driver(True))
                standbys[1].wait_step("warm", PROGRESS_S)
        step("more input after the last takeover")
        campaign.finish()
    finally:
        campaign.close()


def running_past_batch_1(spark: Any, kafka: KafkaConfig, topic: str, tmp_path: Path) -> tuple[Any, str, Callable[[], int]]:
    """The example Kafka transactional query on ``topic``, running in ``spark``, once Spark logged
    batch 1 complete: the query, its checkpoint, and the latest batch Spark logged complete."""
    produce_input(kafka, topic, COUNT)
    out = f"{topic}-out"
    create_topic(kafka, out, partitions=2)
    ctx = PipelineContext(kafka.bootstrap_servers, topic, out, str(tmp_path / "checkpoint"),
                          trigger=Trigger(processing_time="1 second"), max_offsets_per_trigger=50)
    query = start_example("kafka-transactional", spark, ctx)
    spark_log = SparkLog(ctx.checkpoint)

    def committed() -> int:
        latest = spark_log.latest_completed()
        return -1 if latest is None else latest

    deadline = time.monotonic() + 120
    while committed() < 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert committed() >= 1, "the query committed no batch"
    return query, ctx.checkpoint, committed


def test_a_driver_whose_lease_another_run_took_stops_and_journals_nothing_more(
    spark: Any, kafka: KafkaConfig, topic: str, tmp_path: Path,
) -> None:
    query, checkpoint, committed = running_past_batch_1(spark, kafka, topic, tmp_path)
    # A standby on another host took the lease over, as if this driver had been paused past its
    # expiry, and its first writer recorded the newer epoch it took at the sinks (QueryLease.stamp).
    held = json.loads((Path(checkpoint) / LEASE).read_text())
    assert held["epoch"] >= 1, f"the running query's epoch is not in its lease: {held}"
    (Path(checkpoint) / LEASE).write_text(json.dumps(
        {"host": "standby-host", "pid": 1, "process": "standby", "renewed_at": time.time() + 60, "run": "standby",
         "epoch": held["epoch"] + 1}))
    taken = committed()
    with pytest.raises(Exception, match="lease is held by another driver"):
        query.await_termination(60)
        raise AssertionError("the query went on after losing its lease")
    assert committed() <= taken + 1  # at most the batch in flight at the takeover


def test_a_run_fenced_at_its_target_is_caught_on_the_driver_as_fenced_error(
    spark: Any, kafka: KafkaConfig, topic: str, tmp_path: Path,
) -> None:
    """A newer run takes the sink's epoch at the target (as a standby's first writer does) while
    this driver's query runs, its lease untouched: the query's next stream writer, in a Python
    worker of Spark's driver, is refused, and ``except FencedError`` catches it on the driver
    (Spark's exception chained). Nothing more is journaled."""
    query, checkpoint, committed = running_past_batch_1(spark, kafka, topic, tmp_path)
    CheckpointEngine.of(query.sink, checkpoint).start_run("a-newer-run")
    taken = committed()
    with pytest.raises(FencedError) as refused:
        query.await_termination(60)
        raise AssertionError("the query went on after a newer run took its sink over")
    assert "StreamingQueryException" in type(refused.value.__cause__).__name__
    assert committed() <= taken + 1  # at most the batch in flight


@pytest.mark.long(65)
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
                          trigger=Trigger(processing_time="1 second"), max_offsets_per_trigger=500)
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

"""One simulated deployment of a query: two or three driver processes (one active, the others
warm standbys) on one checkpoint, an executor whose tasks outlive a dead driver, PostgreSQL and
Kafka models, and the kit's real code: the run's writer steps (:mod:`oncekit.core.run`), the
engine, the lease and its keeper, the listener's notifications, each sink's protocol.

Spark's part is played here as Spark plays it: the offset and commit logs are written once per
batch (a second writer of either fails its query, as HDFS's rename does), a batch is replayed
from its offsets, a task is retried with a new attempt id, a batch whose task failed four
times is aborted, and the query fails. The faults: a driver killed (a supervisor starts a new
standby a little later) or paused past its lease, the executor paused, a task that fails after
its pre-commit.

After the schedule: every input record is in each target exactly once, nothing is left
prepared, no batch is lost, no upserted value went back to an older batch's, and the query
finished within the step budget after its last fault.
"""

from __future__ import annotations

import collections
import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

import oncekit
from oncekit.core import clock, crash, parallel
from oncekit.core.engine import CheckpointEngine
from oncekit.core.errors import CommitError, LeaseHeldError, LeaseLostError, NonDeterministicReplayError
from oncekit.core.fanout import fan_out
from oncekit.core.lease import RENEW_S, Driver, LeaseKeeper, wait_free
from oncekit.core.protocol import Committable, SinkConfig, TaskInfo
from oncekit.core.restart import superseded
from oncekit.core.run import QueryRun, WatchedRun, commit_batch, open_run, settle
from oncekit.core.spark_log import SparkLog
from oncekit.connectors import kafka as kafka_connector
from oncekit.connectors.kafka import CLIENTS, register_clients
from oncekit.sinks.kafka import _common as kafka_common
from oncekit.sinks.kafka import _markers as kafka_markers
from oncekit.sinks.kafka import kafka_sink
from oncekit.sinks.kafka._common import LatestInit
from oncekit.sinks.postgres import postgres_sink
from oncekit.sinks.postgres._target import register_target
from tests.sim.kafka import SERVERS_PREFIX, Clients, Cluster
from tests.sim.postgres import DSN_PREFIX, PgServer, SimPostgresTarget
from tests.sim.scheduler import Choices, Process, Scheduler, VirtualClock
from tests.sim.storage import MemoryStore, install, uninstall

PROTOCOLS = ("postgres-two-phase-commit", "postgres-write-ahead-log", "postgres-idempotent", "kafka-transactional",
             "kafka-write-ahead-log", "fan-out")
"""Every exactly-once protocol of the kit, and a fan-out of one query into a PostgreSQL table by
two-phase commit and a Kafka topic by write-ahead log."""
POLL_S = 0.5
"""How soon the listener tries a failed notification again."""
TASK_ATTEMPTS = 4
RESTART_S = 1.0
SUPERVISOR_S = 5.0
"""How long after a driver died its supervisor starts a new standby."""


class SparkConcurrentUpdate(Exception):
    """Spark's CONCURRENT_STREAM_LOG_UPDATE: another query wrote this batch's log entry."""


class BatchFailed(Exception):
    """A task failed :data:`TASK_ATTEMPTS` times: Spark aborts the batch and fails the query."""


class TaskFailed(Exception):
    """The simulation failed a task attempt after its pre-commit (an executor lost)."""


class Violation(AssertionError):
    """An invariant of exactly-once does not hold."""


@dataclass(frozen=True)
class Scenario:
    protocol: str
    batches: int = 3
    partitions: int = 2
    rows: int = 2
    """A batch's input: ``partitions`` of ``rows`` rows each."""
    writer_tasks: tuple[int, ...] = (1, 2, 3)
    """The counts of tasks a run may split each batch's input into, one drawn per run: Spark
    plans a replayed batch anew, and a restart may change the plan (``repartition(2)`` to
    ``repartition(4)``, or a standby with other cores). ``start_query``'s check of the plan
    (outside the simulation) refuses another plan while a batch of a sink that commits in its
    tasks is pending; the simulation leaves it out for the idempotent sink, which must hold
    without it (where a session cannot show its plan, nothing is checked), and keeps it for the
    transactional Kafka sink, which cannot (:meth:`World.plan_tasks`)."""
    drivers: int = 2
    faults: int = 3
    fault_one_in: int = 60
    """Between two steps, a fault comes about once in this many steps (while the budget lasts)."""
    max_steps: int = 40_000

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"no simulated protocol {self.protocol!r}; one of {', '.join(PROTOCOLS)}")


@dataclass(eq=False)
class SimDriver:
    process: Process
    identity: Driver
    standby: bool
    attempts: itertools.count = field(default_factory=itertools.count)  # Spark's task attempt ids, per application


class SimKeeper(LeaseKeeper):
    """The real keeper; its renewal loop an actor of the driver's process instead of a thread."""

    world: World
    sim_driver: SimDriver

    def start_renewing(self, stop: Any) -> Any:
        def loop() -> None:
            while not stop.is_set() and not self.world.finished:
                clock.sleep(RENEW_S)
                if stop.is_set():
                    return
                self.renew_once()

        self.world.scheduler.spawn(f"{self.sim_driver.process.name}/keeper", self.sim_driver.process, loop)
        return None


class World:
    def __init__(self, scenario: Scenario, choices: Choices, trace: bool = False) -> None:
        self.scenario = scenario
        self.scheduler = Scheduler(choices, trace)
        self.choices = choices
        self.name = f"w{next(_WORLDS)}"
        self._tokens = itertools.count(1)
        self.store = MemoryStore(self.scheduler)
        self.checkpoint = f"{install(self.name, self.store)}/cp"
        self.pg = PgServer(self.scheduler)
        register_target(DSN_PREFIX, lambda config: SimPostgresTarget(config, self.pg))
        self.kafka = Cluster(self.scheduler)
        self.servers = f"{SERVERS_PREFIX}{self.name}"
        register_clients(self.servers, Clients(self.kafka))
        self.config = self._config(scenario.protocol)
        self.executor = Process("executor")
        self.drivers: list[SimDriver] = []
        self.finished = False
        self.faults_left = scenario.faults
        self.last_fault_step = 0
        self.violations: list[str] = []
        self.latest_commit = -1
        """The newest batch in Spark's commit log, as its progress events tell the listeners."""
        self.planned_with: dict[int, int] = {}
        """The task count of the run that planned each batch (its offset-log entry)."""
        self.store.put("/cp/metadata", json.dumps({"id": "query-1"}).encode())

    # -- the query -----------------------------------------------------------------------------

    def _config(self, protocol: str) -> SinkConfig:
        dsn = f"{DSN_PREFIX}db"
        if protocol == "fan-out":
            return fan_out({"a": postgres_sink(dsn, "out_a", "two-phase-commit", columns=("id", "payload")),
                            "b": kafka_sink(self.servers, "out_b", "write-ahead-log", partitions=2,
                                            columns=("key", "value"))},
                           route_column="target")
        if protocol.startswith("kafka-"):
            return kafka_sink(self.servers, "out", protocol.removeprefix("kafka-"), partitions=2, columns=("key", "value"))
        kind = protocol.removeprefix("postgres-")
        return postgres_sink(dsn, "out", kind, columns=("id", "payload"), key_columns=("id",) if kind == "idempotent" else ())

    def rows(self, batch_id: int, partition: int) -> list[dict[str, Any]]:
        """What partition ``partition`` of batch ``batch_id`` holds, the same at every replay."""
        if self.scenario.protocol == "postgres-idempotent":
            return [{"id": partition * 10 + k, "payload": f"{batch_id:04d}"} for k in range(self.scenario.rows)]
        out: list[dict[str, Any]] = [{"id": batch_id * 1000 + partition * 100 + k, "payload": f"b{batch_id}p{partition}"}
                                     for k in range(self.scenario.rows)]
        if self.scenario.protocol.startswith("kafka-") or self.scenario.protocol == "fan-out":
            for row in out:
                row["key"], row["value"] = str(row["id"]), f"{row['id']}:{row['payload']}"
                if self.scenario.protocol == "fan-out":
                    row["target"] = "a" if row["id"] % 2 else "b"
        return out

    def batches_of(self, batch_id: int, task: int, tasks: int) -> Iterator[pa.RecordBatch]:
        """Task ``task``'s input of batch ``batch_id`` planned in ``tasks`` tasks: every
        ``tasks``-th row of the batch, so that any plan gives the batch the same rows."""
        key = (self.scenario.protocol, self.scenario.rows, self.scenario.partitions, batch_id, task, tasks)
        if key not in _BATCHES:
            rows = [row for p in range(self.scenario.partitions) for row in self.rows(batch_id, p)]
            _BATCHES[key] = pa.RecordBatch.from_pylist(rows[task::tasks])
        yield _BATCHES[key]

    def plan_tasks(self, pending: int | None) -> int:
        """How many tasks a run splits each batch into (:attr:`Scenario.writer_tasks`); for the
        transactional Kafka sink, a run that finds batch ``pending`` planned and not complete
        keeps the count that planned it, as ``start_query``'s plan check makes it."""
        drawn = self.scenario.writer_tasks[self.choices.pick(len(self.scenario.writer_tasks))]
        if self.scenario.protocol == "kafka-transactional" and pending is not None:
            return self.planned_with.get(pending, drawn)
        return drawn

    # -- processes -----------------------------------------------------------------------------

    def add_driver(self, standby: bool) -> SimDriver:
        process = Process(f"driver{len(self.drivers) + 1}")
        driver = SimDriver(process, Driver(f"sim-{process.name}", len(self.drivers) + 100, f"{self.name}-{process.name}", ""),
                           standby)
        self.drivers.append(driver)
        self.scheduler.spawn(f"{process.name}/main", process, lambda: self.driver_main(driver))
        return driver

    def driver_main(self, driver: SimDriver) -> None:
        keeper = SimKeeper(self.checkpoint, driver.identity)
        keeper.world, keeper.sim_driver = self, driver
        while not self.finished:
            if driver.standby:
                wait_free([self.checkpoint], driver=driver.identity)  # polled as the kit polls
                if self.finished:
                    return
            token = f"run{next(self._tokens)}"  # a run's token, unique in the world (the kit's: random)
            try:
                keeper.hold(token)
            except LeaseHeldError:
                driver.standby = True
                continue
            try:
                self.run_query(driver, keeper, token)
                keeper.release()
                self.finished = True
                return
            except Exception as exc:  # noqa: BLE001 - what the restart strategy sees
                self.judge(exc)
                self.sweep_later(driver, token)
                if superseded(exc):
                    driver.standby = True  # another driver runs the query: wait again
                    continue
                keeper.idle()
                clock.sleep(RESTART_S)

    def judge(self, exc: BaseException) -> None:
        """Errors a correct protocol never raises, whatever the schedule."""
        text = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, (NonDeterministicReplayError, FileNotFoundError)) or (
                isinstance(exc, CommitError) and ("output for this partition is lost" in str(exc)
                                                  or "is a decision" in str(exc))):
            self.violations.append(text)

    def sweep_later(self, driver: SimDriver, token: str) -> None:
        """The failed run's straggler sweep, as the batch watchdog does it 3 s after the failure."""
        def sweep() -> None:
            clock.sleep(3.0)
            engine = CheckpointEngine.for_run(self.config, self.checkpoint, token)
            if engine is not None:
                try:
                    engine.abort_unfinished()
                except Exception as exc:  # noqa: BLE001 - the next start's recovery settles it
                    self.judge(exc)

        self.scheduler.spawn(f"{driver.process.name}/sweep", driver.process, sweep)

    def run_query(self, driver: SimDriver, keeper: SimKeeper, token: str) -> None:
        """One run of the query, as Spark runs it: a stream writer for every batch (the run's first
        is the first writer), its tasks, the driver commit, the commit log; when the input is
        drained the run stops as ``OncekitQuery.stop`` does. Spark reads its offset and commit logs
        at the run's start and then keeps the batch id in memory: an entry another run wrote
        meanwhile fails this run's write of it (:meth:`write_once`)."""
        run = QueryRun(token, listener=True, committer=False, version=oncekit.__version__, driver=driver.identity)
        state = {"running": True}
        self.scheduler.spawn(f"{driver.process.name}/listener {token}", driver.process,
                             lambda: self.listener(token, state))
        log = SparkLog(self.checkpoint)
        planned, completed = log.latest_planned(), log.latest_completed()  # read once, at the start
        tasks = self.plan_tasks(planned if planned is not None and (completed is None or planned > completed) else None)
        try:
            while True:
                if keeper.taken_by() is not None:
                    raise LeaseLostError(f"lease taken by {keeper.taken_by()}")
                if planned is not None and (completed is None or planned > completed):
                    batch_id = planned
                else:
                    batch_id = 0 if completed is None else completed + 1
                    if batch_id >= self.scenario.batches:
                        break
                    self.write_once(f"/cp/offsets/{batch_id}")
                    self.planned_with[batch_id] = tasks
                    planned = batch_id
                epoch = open_run(self.config, self.checkpoint, run)[0].epoch  # the batch's stream writer
                try:
                    committables = self.run_tasks(driver, epoch, batch_id, tasks)
                except BatchFailed as failed:
                    CheckpointEngine.of(self.config, self.checkpoint, epoch).abort(batch_id, failed.args[0])
                    raise
                commit_batch(CheckpointEngine.of(self.config, self.checkpoint, epoch), run, batch_id, committables)
                self.write_once(f"/cp/commits/{batch_id}")
                completed = batch_id
        finally:
            state["running"] = False
        settle(self.config, self.checkpoint, run)
        engine = CheckpointEngine.for_run(self.config, self.checkpoint, token)
        if engine is not None:
            engine.abort_unfinished()

    def listener(self, token: str, state: dict[str, bool]) -> None:
        """The checkpoint listener of one run: notifications as Spark's progress events come (a
        batch's event once its commit-log entry exists; after a failed notification, the next
        event, :data:`POLL_S` later), acting for the run's epoch as the kit's does (:class:`WatchedRun`)."""
        notified = -1
        watched = WatchedRun(self.config, self.checkpoint, token)

        def event() -> bool:
            return not state["running"] or self.latest_commit > notified

        while state["running"]:
            self.scheduler.wait_until(event, 3600.0, "progress event")
            if not state["running"]:
                return
            latest = self.latest_commit  # what the event says
            if latest > notified:
                try:
                    engine = watched.engine()
                    if engine is not None:
                        engine.complete(latest)
                    notified = latest
                except Exception as exc:  # noqa: BLE001 - as the listener: logged, retried at the next event
                    self.judge(exc)
                    clock.sleep(POLL_S)

    def write_once(self, path: str) -> None:
        """Spark's log entry, created if absent (HDFS's rename): a second writer fails its query."""
        self.scheduler.step(lambda: f"spark log {path}")
        if path in self.store.files:
            raise SparkConcurrentUpdate(f"{path} was written by another query")
        self.store.put(path, b"v1")
        if path.startswith("/cp/commits/"):
            self.latest_commit = max(self.latest_commit, int(path.rsplit("/", 1)[1]))

    def run_tasks(self, driver: SimDriver, epoch: int, batch_id: int, tasks: int) -> list[Committable]:
        results: dict[int, list[Committable]] = {}
        failures: collections.Counter[int] = collections.Counter()
        running: dict[int, Any] = {}
        ended = [0, 0]  # tasks ended, and how many of them the loop below has seen

        def task(partition: int, attempt: int) -> None:
            try:
                info = TaskInfo(self.config.sink_id, batch_id, partition, attempt, epoch)
                written = CheckpointEngine.of(self.config, self.checkpoint, epoch).write_task(
                    info, self.batches_of(batch_id, partition, tasks))
                if self.faults_left > 0 and self.choices.chance(8):
                    self.fault(f"task {batch_id}/{partition} attempt {attempt} fails after its pre-commit")
                    raise TaskFailed()
                results[partition] = written
            finally:
                ended[0] += 1

        def launch(partition: int) -> None:
            attempt = next(driver.attempts)
            running[partition] = self.scheduler.spawn(f"task {batch_id}/{partition}#{attempt}", self.executor,
                                                      lambda: task(partition, attempt))

        for partition in range(tasks):
            launch(partition)
        while len(results) < tasks:
            self.scheduler.wait_until(lambda: ended[0] > ended[1], 3600.0, "tasks")
            ended[1] = ended[0]
            for partition, actor in list(running.items()):
                if not actor.done:
                    continue
                del running[partition]
                if partition in results:
                    continue
                failures[partition] += 1
                if failures[partition] >= TASK_ATTEMPTS:
                    raise BatchFailed([c for cs in results.values() for c in cs])
                launch(partition)
        return [c for p in sorted(results) for c in results[p]]

    # -- faults --------------------------------------------------------------------------------

    def fault(self, what: str) -> None:
        self.faults_left -= 1
        self.last_fault_step = self.scheduler.steps
        if self.scheduler.trace is not None:
            self.scheduler.trace.append(f"{self.scheduler.time:9.3f} ** {what}")

    def between(self) -> None:
        """Before each step: maybe a fault (a driver killed or paused, the executor paused)."""
        if self.faults_left <= 0 or self.finished or not self.choices.chance(self.scenario.fault_one_in):
            return
        live = [d for d in self.drivers if not d.process.dead]
        kind = self.choices.pick(3)
        if kind == 0 and live:
            victim = live[self.choices.pick(len(live))]
            self.fault(f"kill {victim.process.name}")
            self.scheduler.kill(victim.process)

            def supervisor() -> None:
                clock.sleep(SUPERVISOR_S)
                self.add_driver(standby=True)

            self.scheduler.spawn("supervisor", Process("supervisor"), supervisor)
        elif kind == 1 and live:
            victim = live[self.choices.pick(len(live))]
            seconds = (1, 4, 12, 30)[self.choices.pick(4)]
            self.fault(f"pause {victim.process.name} {seconds} s")
            self.scheduler.pause(victim.process, seconds)
        else:
            seconds = (1, 5, 20)[self.choices.pick(3)]
            self.fault(f"pause executor {seconds} s")
            self.scheduler.pause(self.executor, seconds)

    # -- the schedule --------------------------------------------------------------------------

    def run(self) -> None:
        """Run the schedule and check the invariants; Violation when one fails."""
        previous_clock = clock.use(VirtualClock(self.scheduler))
        previous_crash_dir, crash._DIRECTORY = crash._DIRECTORY, None
        previous_init, kafka_common.LATEST_INIT = kafka_common.LATEST_INIT, _NoLatestInit(Path("/nonexistent"))
        parallel.run_inline(True)
        try:
            self.add_driver(standby=False)
            for _ in range(self.scenario.drivers - 1):
                self.add_driver(standby=True)
            ended = self.scheduler.run(self.scenario.max_steps, self.between)
            self.scheduler.close()
            self.check(ended)
        finally:
            clock.use(previous_clock)
            crash._DIRECTORY = previous_crash_dir
            kafka_common.LATEST_INIT = previous_init
            parallel.run_inline(False)
            CLIENTS._idle.clear()  # this world's clients: no other world reaches its cluster
            kafka_connector._CLIENTS_OF.pop(self.servers, None)  # nor its servers (each lookup scans them)
            uninstall(self.name)
            kafka_markers._partitions_seen.clear()  # nor knows its marker topics

    def check(self, ended: bool) -> None:
        if self.violations:
            raise Violation(f"a protocol error no schedule may cause: {self.violations[0]}")
        if self.scheduler.strays:
            raise Violation(f"the simulation itself went wrong: {self.scheduler.strays[0]}")
        if not ended or not self.finished:
            raise Violation(f"no progress: the query did not finish within {self.scenario.max_steps} steps "
                            f"(last fault at step {self.last_fault_step})")
        for table, expected in self.expected().items():
            if self.scenario.protocol == "postgres-idempotent":
                got: Any = dict(self.pg.upserted[table])
            elif table in self.kafka.topics:
                got = collections.Counter((k.decode(), v.decode()) for k, v in self.kafka.committed(table)
                                          if k is not None and v is not None)
            else:
                got = collections.Counter(self.pg.appended[table])
            if got != expected:
                raise Violation(f"table {table}: committed output differs from the input: "
                                f"missing {_diff(expected, got)}, extra {_diff(got, expected)}")
        if self.pg.prepared:
            raise Violation(f"prepared transactions left: {sorted(self.pg.prepared)}")
        seen: dict[tuple[str, Any], str] = {}
        for (_, table, key, value) in self.pg.history:
            if value < seen.get((table, key), ""):
                raise Violation(f"table {table} key {key}: value {value} written after {seen[(table, key)]}: a newer "
                                "run's output was changed")
            seen[(table, key)] = max(value, seen.get((table, key), ""))

    def expected(self) -> dict[str, Any]:
        rows = [row for b in range(self.scenario.batches) for p in range(self.scenario.partitions) for row in self.rows(b, p)]
        if self.scenario.protocol == "postgres-idempotent":
            return {"out": {row["id"]: row["payload"] for row in rows}}
        if self.scenario.protocol == "fan-out":
            return {"out_a": collections.Counter((r["id"], r["payload"]) for r in rows if r["target"] == "a"),
                    "out_b": collections.Counter((r["key"], r["value"]) for r in rows if r["target"] == "b")}
        if self.scenario.protocol.startswith("kafka-"):
            return {"out": collections.Counter((r["key"], r["value"]) for r in rows)}
        return {"out": collections.Counter((r["id"], r["payload"]) for r in rows)}


_BATCHES: dict[tuple[Any, ...], pa.RecordBatch] = {}
_WORLDS = itertools.count(1)
"""Names the worlds of a process apart (their storage and Kafka servers are registered by name)."""


class _NoLatestInit(LatestInit):
    """No record of which process initialised a producer last (one process here: every pooled
    producer is tried, and the model's fencing tells), without the real one's file system calls."""

    def record(self, transactional_id: Any) -> None:
        pass

    def here(self, transactional_id: Any) -> bool:
        return True


def _diff(left: Any, right: Any) -> list[Any]:
    if isinstance(left, dict) and not isinstance(left, collections.Counter):
        return sorted(f"{k}={v}" for k, v in left.items() if right.get(k) != v)[:5]
    return sorted((collections.Counter(left) - collections.Counter(right)).elements())[:5]


"""The fault campaign behind ``oncekit verify``.

:func:`run_campaign` runs one pipeline in a driver process of its own, continuously, and injects
faults one after another (:func:`~oncekit.verify.faults.schedule`): crash points of the engine
(task points are retried by Spark itself; driver points fail the query, which the driver's
restart strategy brings back; ``before_notify`` may take the whole driver process), ``kill -9``
of the driver process, Kafka or PostgreSQL stopped and restarted, or cut off the network. Before
each fault it produces a new chunk of input; after it, it waits until the output has caught up
(restarting the driver process when it died, as an operator would) and compares everything
committed so far with everything produced so far. At the end it stops the driver and checks that
no prepared transaction and no open Kafka transaction is left.

Runs are reproducible from a seed: the fault schedule is drawn from ``random.Random(seed)``.
"""

from __future__ import annotations

import hashlib
import logging
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
from confluent_kafka import KafkaException

from oncekit.connectors import Services
from oncekit.connectors.kafka_admin import create_topic, end_offsets
from oncekit.connectors.services.spark_cluster import StandaloneCluster
from oncekit.core.crash import POINTS, arm, disarm, fired_at
from oncekit.core.errors import ConfigError
from oncekit.core.journal import Journal
from oncekit.core.spark_log import SparkLog
from oncekit.verify.as_written import JobInput, JobOutput, clean_run
from oncekit.verify.checker import GUARANTEES, Verdict, compare
from oncekit.verify.clusterfaults import ClusterFaults
from oncekit.verify.driver import DriverProcess
from oncekit.verify.examples import EXAMPLES, PER_BATCH, PipelineContext, sink_kind
from oncekit.verify.faults import CLUSTER_FAULTS, OUTAGES, POSTGRES_FAULTS, Fault, postgres_steps, schedule
from oncekit.verify.io import KafkaOutput, PipelineOutput, Upstream, prepare_target, produce_input
from oncekit.verify.pgfaults import PostgresFaults, install_holds
from oncekit.verify.report import CampaignReport, FaultResult

logger = logging.getLogger(__name__)

CHUNK = 300  # input produced before each fault of a campaign: one batch of PER_BATCH, rows in both partitions

class Campaign:
    """One pipeline, one driver, faults one after another; see the module docstring.

    Called by :func:`run_campaign` (and ``oncekit verify``); ``work`` holds the checkpoint, the
    crash points and the driver's log."""

    def __init__(self, pipeline: str, services: Services, name: str, work: Path,
                 chunk: int = CHUNK, per_batch: int = PER_BATCH, env: dict[str, str] | None = None,
                 catch_up_s: float = 240.0, quiet_s: float = 30.0, upstream: Upstream | None = None,
                 spark_cluster: StandaloneCluster | None = None, job: JobInput | None = None) -> None:
        self.pipeline, self.services, self.work, self.job = pipeline, services, work, job
        self.kind = "job" if job is not None else sink_kind(pipeline)
        self.kafka = services.kafka.config
        self.chunk, self.catch_up_s, self.quiet_s = chunk, catch_up_s, quiet_s
        self.ctx = campaign_context(services, name, self.kind, work, per_batch)
        topic, output = self.ctx.input_topic, self.ctx.output
        self.spark_log = SparkLog(self.ctx.checkpoint)
        self.crash_dir = str(work / "crash")
        Path(self.crash_dir).mkdir(parents=True, exist_ok=True)
        create_topic(self.kafka, topic, partitions=2)
        self.target: PipelineOutput | JobOutput
        if job is not None:  # a job as written: it names its tables, the harness creates them (as_written)
            self.target = JobOutput(self.kafka, services.postgres.dsn, self.ctx.checkpoint, output)
        else:
            prepare_target(pipeline, self.kafka, services.postgres.dsn, output)
            if self.kind != "kafka":
                install_holds(services.postgres.dsn, output)
            self.target = PipelineOutput(self.kind, self.kafka, services.postgres.dsn, output)
        self.postgres_faults = PostgresFaults(services.postgres, output, self.crash_dir)
        self.cluster_faults = ClusterFaults(services.kafka, output if self.kind in ("kafka", "fan-out") else topic,
                                            self.crash_dir, self.spark_log, spark_cluster)
        self.driver = DriverProcess(pipeline, self.ctx, self.crash_dir, work / "driver.log", env or {},
                                    as_written=job is not None)
        self.expected: list[int] = []
        self.upstream = upstream
        self.produced = 0
        self.stalls: list[str] = []  # stack dumps of faults the pipeline did not catch up on in time

    def observe(self) -> list[Hashable] | None:
        """:meth:`output`, or None while a service it reads is unreachable (a fault in progress,
        or a connection it broke): the wait loop looks again."""
        try:
            return self.output()
        except (psycopg.OperationalError, KafkaException) as exc:
            logger.info("verify: output unreadable for now (%s)", exc)
            return None

    @property
    def kafka_output(self) -> KafkaOutput | None:
        """The output topic's reader, when the pipeline writes to one."""
        return self.target.kafka

    def output(self) -> list[Hashable]:
        """Every record committed so far (:meth:`PipelineOutput.read`)."""
        return self.target.read()

    def wanted(self) -> list[Hashable]:
        """What :meth:`output` must hold for the input so far."""
        return self.target.wanted(self.expected)

    def query_restarts(self) -> int:
        path = Path(self.ctx.checkpoint + ".restarts")
        return len(path.read_text().splitlines()) if path.exists() else 0

    def batch_in_flight(self) -> int | None:
        return self.spark_log.latest_planned()

    def run(self, fault: Fault) -> FaultResult:
        """Produce the next chunk, inject ``fault``, wait for the output to catch up, check."""
        restarts_before, driver_before = self.query_restarts(), self.driver.restarts
        self.driver.ensure_running()
        if fault.kind == "crash":  # the next batch, the first to read the chunk produced below
            arm(self.crash_dir, fault.point or "", (self.batch_in_flight() or 0) + 1)
        self.cluster_faults.before_input(fault)
        if self.job is not None and isinstance(self.target, JobOutput):
            self.job.produce(self.kafka, self.ctx.input_topic, self.target.produced)
            self.target.produced += 1
        else:
            self.expected += produce_input(self.kafka, self.ctx.input_topic, self.chunk, first=self.produced,
                                           upstream=self.upstream)
        self.produced += self.chunk
        ended, batch = self.inject(fault)
        caught_up, ended, batch, next_commit, timed_out = self._await_output(fault, ended, batch)
        stalled = timed_out and caught_up is None
        if stalled:
            # Not caught up and settled by the deadline: a liveness failure, whatever the output
            # holds (missing records, or a planned batch never committed). Where the pipeline
            # waits goes into the report; the driver is then killed and restarted, so that the
            # output can still be judged exactly-once.
            complete = compare(self.wanted(), self.output()).name == "exactly-once"
            what = "output complete, but a planned batch left uncommitted" if complete else "no progress"
            self.stalls.append(f"fault {fault}: {what} in {self.catch_up_s:.0f} s; stacks of the driver's "
                               f"processes, then the driver killed and restarted:\n{self.driver.stacks()}")
            self.driver.kill()
            caught_up, _, _, _, _ = self._await_output(fault, time.monotonic(), batch)
        if fault.kind == "crash" and ended is None:
            disarm(self.crash_dir, fault.point or "")
        verdict = compare(self.wanted(), self.output())
        start = ended if ended is not None else time.monotonic()
        recovery = max(0.0, round(caught_up - start, 1)) if caught_up is not None else float("nan")
        to_commit = max(0.0, round(next_commit - start, 1)) if next_commit is not None else float("nan")
        return FaultResult(str(fault), ended is not None, batch, self.query_restarts() - restarts_before,
                           self.driver.restarts - driver_before, recovery,
                           verdict.name, verdict.summary(3) + self.postgres_faults.note(fault.kind)
                           + self.cluster_faults.note(fault.kind), stalled, to_commit)

    def _await_output(self, fault: Fault, ended: float | None, batch: int | None
                      ) -> tuple[float | None, float | None, int | None, float | None, bool]:
        """Wait (restarting the driver whenever it dies) until the output holds everything
        produced and has settled, or nothing more can come, or ``catch_up_s`` passed. Returns
        when it caught up (or None), when the fault ended and the batch it hit (a crash point's
        are known only once it fired), when Spark first committed a batch after the fault's end
        (None if it did not), and whether the wait ran out of time."""
        caught_up, last_change, next_commit = None, time.monotonic(), None
        seen: tuple[int, int | None, int | None] | None = None
        committed_at_end = self.batch_committed() if ended is not None else None
        reconnected = 0.0
        deadline = time.monotonic() + self.catch_up_s
        want = Counter(self.wanted())
        while time.monotonic() < deadline:
            if fault.kind == "crash" and ended is None:
                where = fired_at(self.crash_dir, fault.point or "")
                if where is not None:
                    ended, batch = time.monotonic(), where.get("batch")
                    committed_at_end = self.batch_committed()
            if ended is not None and next_commit is None and (self.batch_committed() or -1) > (committed_at_end or -1):
                next_commit = time.monotonic()
            self.driver.ensure_running()
            got = self.observe()
            if got is None:
                time.sleep(0.3)
                continue
            progress = (len(got), self.batch_in_flight(), self.batch_committed())
            if progress != seen:
                seen, last_change = progress, time.monotonic()
            done = self.idle() and self.driver.running_query()
            if not (want - Counter(got)) and done:
                caught_up = caught_up or time.monotonic()
                if time.monotonic() - last_change > 1.0:  # settled: late duplicates would have shown
                    break
            quiet = time.monotonic() - last_change
            if done and quiet > self.quiet_s and self._drained():
                # Spark has planned and committed all the input and nothing changed since: what
                # is missing is lost. Short of that (a query restarting, a service coming back),
                # the loop waits until the deadline.
                break
            if self.kafka_output is not None and quiet > 10 and time.monotonic() - reconnected > 10:
                self.kafka_output.reconnect()
                reconnected = time.monotonic()
            time.sleep(0.3)
        else:
            return caught_up, ended, batch, next_commit, True
        return caught_up, ended, batch, next_commit, False

    def batch_committed(self) -> int | None:
        return self.spark_log.latest_completed()

    def idle(self) -> bool:
        """Spark has committed every batch it planned."""
        planned = self.batch_in_flight()
        return planned is not None and planned == self.batch_committed()

    def _drained(self) -> bool:
        """The latest planned batch ends at the input topic's end (no input is left to plan) and
        every batch the kit's journals hold is committed to its sink. A restarted driver commits
        a completed checkpoint's prepared transactions only in the recovery its query starts
        with; on a loaded standalone cluster that came more than ``quiet_s`` after the query
        started, and a campaign judged the batch lost while it was still to be committed."""
        planned = self.batch_in_flight()
        if planned is None:
            return False
        try:
            ends = {int(p): o for p, o in self.spark_log.source_offsets(planned)[0][self.ctx.input_topic].items()}
            if ends != end_offsets(self.kafka, self.ctx.input_topic):
                return False
            for sink in Path(self.ctx.checkpoint, "oncekit").glob("*/journal"):
                journaled, done = Journal(self.ctx.checkpoint, sink.parent.name).entries()
                if journaled - done:
                    return False
            return True
        except (OSError, LookupError, TypeError, ValueError, KafkaException):
            return False  # a source without offsets, or a log being written: not known to be drained

    def inject(self, fault: Fault) -> tuple[float | None, int | None]:
        """Called by :meth:`run` and by the soak (:mod:`oncekit.verify.soak`): inject ``fault``;
        returns when it ended and the batch in flight (None, None for a crash point, which the
        caller sees fire)."""
        if fault.kind == "crash":
            return None, None
        time.sleep(fault.delay_s)
        batch = self.batch_in_flight()
        if fault.kind == "kill":
            self.driver.kill()
            return time.monotonic(), batch
        if fault.kind in CLUSTER_FAULTS:
            fired = self.cluster_faults.inject(fault)
            return (time.monotonic() if fired else None), batch
        if fault.kind in POSTGRES_FAULTS:
            fired = self.postgres_faults.inject(fault.kind, fault.outage_s)
            return (time.monotonic() if fired else None), batch
        service = self.services.kafka if fault.kind.startswith("kafka") else self.services.postgres
        service.outage(OUTAGES[fault.kind.partition("-")[2]], fault.outage_s)
        return time.monotonic(), batch

    def finish(self) -> tuple[int | None, Verdict, list[str]]:
        """Stop the driver gracefully; returns its exit code, the verdict over all input, and
        what it left behind (prepared transactions, partitions with an open Kafka transaction)."""
        code = self.driver.stop()
        final = compare(self.wanted(), self.output())
        left = self.target.left_open()
        left += [f"prepared transaction {gid} lost by crash recovery" for gid in self.postgres_faults.lost]
        self.target.close()
        return code, final, left


def run_campaign(pipeline: str, services: Services, faults: int | list[Fault], seed: int = 1,
                 guarantee: str | None = None, progress: Callable[[int, int, FaultResult], None] | None = None,
                 chunk: int = CHUNK, per_batch: int = PER_BATCH, env: dict[str, str] | None = None,
                 work_dir: str | None = None, upstream: Upstream | None = None,
                 spark_cluster: StandaloneCluster | None = None, services_only: bool = False,
                 records: list[bytes] | None = None,
                 notes: Callable[[str], None] = lambda line: None) -> CampaignReport:
    """Run ``pipeline`` under ``faults`` (a count drawn from ``seed``, or a given schedule) and
    check every verdict against ``guarantee`` (default: what the example promises, else
    exactly-once). On a Kafka cluster of three brokers or more, a drawn schedule includes the
    broker faults when the pipeline writes to Kafka; ``spark_cluster`` (the standalone cluster
    the driver's ``SPARK_MASTER`` in ``env`` names) lets a schedule kill its executors;
    ``services_only`` draws service faults only (see :func:`~oncekit.verify.faults.schedule`).

    ``records``: ``pipeline`` is a job as written (``start(spark)``, :mod:`~oncekit.verify.as_written`),
    fed these records in one chunk per fault and judged against its own clean run (``notes`` hears
    how that run goes)."""
    example = EXAMPLES.get(pipeline)
    job = records is not None
    kind = "job" if job else sink_kind(pipeline)
    guarantee = guarantee or (example.guarantee if example else "exactly-once")
    if guarantee not in GUARANTEES:
        raise ConfigError(f"guarantee {guarantee!r}: choose one of {', '.join(GUARANTEES)}")
    plan = faults if isinstance(faults, list) else schedule(
        seed, faults, example.points if example else POINTS, network_cuts=services.backend == "containers",
        kafka_cluster=len(services.kafka.brokers) >= 3 and kind in ("kafka", "fan-out"),
        postgres_steps=() if job else postgres_steps(kind, example.protocol if example else None),
        services_only=services_only, postgres=kind != "kafka")
    name = f"{pipeline.replace(':', '-').replace('.', '-')}-{seed}-{time.time_ns() % 10**9}"
    with _work(work_dir) as work:
        job_input = JobInput(records, len(plan)) if records is not None else None
        campaign = Campaign(pipeline, services, name, work, chunk, per_batch, env, upstream=upstream,
                            spark_cluster=spark_cluster, job=job_input)
        if job_input is not None and isinstance(campaign.target, JobOutput):
            clean = campaign_context(services, f"{name}-clean", "job", work / "clean", per_batch)
            create_topic(campaign.kafka, clean.input_topic, partitions=2)
            campaign.target.expected = clean_run(pipeline, job_input, clean, campaign.kafka, work / "clean", notes)
        results: list[FaultResult] = []
        try:
            for index, fault in enumerate(plan):
                results.append(campaign.run(fault))
                if progress is not None:
                    progress(index + 1, len(plan), results[-1])
        finally:
            code, final, left = campaign.finish()
        if code not in (0, None):
            left.append(f"driver exited with {code} when stopped")
        log = (work / "driver.log").read_text(errors="replace")[-4000:] if (work / "driver.log").exists() else ""
        log = "\n".join([*campaign.stalls, log])
        return CampaignReport(pipeline, seed, guarantee, results, final.name, left, log)


def campaign_context(services: Services, name: str, kind: str, work: Path, per_batch: int) -> PipelineContext:
    """Where a campaign's run of a pipeline of ``kind`` reads and writes: input topic
    ``verify-<name>``; output ``verify_<name>`` (a topic: ``verify-<name>-out``; a job as written:
    a short prefix of the names it gives, which PostgreSQL keeps within 63 characters)."""
    topic = f"verify-{name}".replace("_", "-")
    output = {"kafka": f"{topic}-out", "job": f"vj_{hashlib.sha1(name.encode()).hexdigest()[:10]}"}.get(
        kind, f"verify_{name}".replace("-", "_"))
    return PipelineContext(services.kafka.bootstrap_servers, topic, output, str(work / "checkpoint"),
                           services.postgres.dsn, max_offsets_per_trigger=per_batch,
                           kafka_client=dict(services.kafka.client))


@contextmanager
def _work(path: str | None) -> Iterator[Path]:
    if path:
        Path(path).mkdir(parents=True, exist_ok=True)
        yield Path(path)
        return
    with tempfile.TemporaryDirectory(prefix="oncekit-verify-") as work:
        yield Path(work)


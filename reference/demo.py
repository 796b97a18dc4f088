"""The main job behind ``make demo`` / ``oncekit demo``: the reference pipeline end to end.

Starts Kafka and PostgreSQL (or uses the configured ones), creates topics and tables, produces a
seeded payments workload (with upstream duplicates, late and malformed records), runs
:class:`~oncekit.reference.pipeline.ReferencePipeline`, crashes it once mid-run with a crash point
and lets the restart strategy bring it back from its checkpoints, prints progress while it runs,
and ends with a report whose every line is checked against what the generator knows it sent
(the outputs are read by :mod:`oncekit.reference.outputs`):

- PostgreSQL balances: per account equal to the unique well-formed payments, so the sum of
  balances equals the sum of unique amounts, with zero duplicates and zero losses;
- Kafka balance updates (read_committed): no update twice, and each account's last update
  equal to its balance;
- per-minute totals, late events and dead letters: exactly the expected rows;
- no prepared transaction left behind.

Spark's own output (its log and its Python workers' prints) goes to ``<work dir>/spark.log``, so
the terminal shows only the demo's lines.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from oncekit.connectors.kafka import KafkaConfig
from oncekit.connectors.services import start_services
from oncekit.core import crash as crash_points
from oncekit.core.deadline import begin
from oncekit.core.spark.watchdog import progress_started
from oncekit.core.spark.session import spark_session
from oncekit.reference.commands import status_page
from oncekit.reference.config import RunConfig, load
from oncekit.reference.generator import Workload, events, produce
from oncekit.reference.outputs import Observed, observe, require_empty
from oncekit.reference.pipeline import ReferencePipeline

if TYPE_CHECKING:
    from oncekit.core.spark.query import OncekitQuery

logger = logging.getLogger(__name__)

SESSION_NAME = "oncekit-demo"
CRASH_POINT = "task_after_pre_commit"
CRASH_BATCH = 1


@dataclass
class Expected:
    """What the pipeline must output for a workload, computed from the generator's own records
    with the pipeline's rules (first occurrence of an event id wins; per account, a payment
    older than the newest event time seen minus the allowed lateness is late)."""

    produced: int = 0
    duplicates: int = 0
    malformed: int = 0
    balances: dict[int, tuple[int, int]] = field(default_factory=dict)
    totals: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)
    late: set[str] = field(default_factory=set)

    @property
    def unique(self) -> int:
        return sum(events for _, events in self.balances.values())

    @property
    def amount(self) -> int:
        return sum(balance for balance, _ in self.balances.values())


def expected(workload: Workload | list[Workload], allowed_lateness_s: int) -> Expected:
    """The expected output of ``workload`` (see :class:`Expected`); several workloads count as
    sent one after the other into the same topic."""
    out = Expected()
    seen: set[str] = set()
    clocks: dict[int, int] = {}
    workloads = workload if isinstance(workload, list) else [workload]
    for event in (e for w in workloads for e in events(w)):
        out.produced += 1
        if event.key == b"malformed":
            out.malformed += 1
            continue
        payment = json.loads(event.value)
        if payment["event_id"] in seen:
            out.duplicates += 1
            continue
        seen.add(payment["event_id"])
        account, amount = int(payment["account_id"]), int(payment["amount_cents"])
        event_ms = int(datetime.fromisoformat(payment["event_time"]).timestamp() * 1000)
        balance, count = out.balances.get(account, (0, 0))
        out.balances[account] = (balance + amount, count + 1)
        clock = clocks.get(account)
        if clock is not None and event_ms < clock - allowed_lateness_s * 1000:
            out.late.add(payment["event_id"])
        else:
            minute = event_ms // 60_000 * 60_000
            total, n = out.totals.get((account, minute), (0, 0))
            out.totals[(account, minute)] = (total + amount, n + 1)
        clocks[account] = event_ms if clock is None else max(clock, event_ms)
    return out


@dataclass
class Timeline:
    """Where the demo's run time went, from the queries' progress: wall-clock times (seconds
    since the epoch) of the run's start and end and of each failure, and per attempt (start of
    the pipeline, then each restart) the progress of its batches that read input."""

    started: float
    ended: float = 0.0
    failures: list[float] = field(default_factory=list)
    attempts: list[list[dict[str, Any]]] = field(default_factory=list)

    def phases(self) -> list[tuple[str, float, int]]:
        """(phase, seconds, records): start-up (run start to the first batch), the first batch,
        the steady state (every later batch of every attempt), each restart (failure to the
        restarted attempt's first batch, restart delay and recovery included), and the rest
        (the batch that crashed, waits between batches, stopping)."""

        def seconds(progress: dict[str, Any]) -> float:
            return int(progress["durationMs"]["triggerExecution"]) / 1000

        batches = [p for attempt in self.attempts for p in attempt]
        if not batches:
            return [("other", self.ended - self.started, 0)]
        first = batches[0]
        out = [("start-up", progress_started(first) - self.started, 0),
               ("first batch", seconds(first), int(first["numInputRows"])),
               ("steady state", sum(seconds(p) for p in batches[1:]), sum(int(p["numInputRows"]) for p in batches[1:]))]
        for failure in self.failures:
            after = [progress_started(attempt[0]) for attempt in self.attempts
                     if attempt and progress_started(attempt[0]) > failure]
            out.append(("restart", (min(after) if after else self.ended) - failure, 0))
        out.append(("other", self.ended - self.started - sum(s for _, s, _ in out), 0))
        return out

    def text(self) -> str:
        return ", ".join(f"{name} {s:.1f} s" + (f" ({n:,} records, {n / s:,.0f}/s)" if n and s > 0 else "")
                         for name, s, n in self.phases())


@dataclass
class Report:
    """The demo's verdict: one line per invariant, each OK or FAILED, and the throughput with
    its :class:`Timeline` when one was kept."""

    lines: list[tuple[str, str, bool]]
    restarts: int
    seconds: float
    produced: int
    timeline: Timeline | None = None

    @property
    def ok(self) -> bool:
        return all(ok for _, _, ok in self.lines)

    @property
    def events_per_s(self) -> float:
        return self.produced / self.seconds if self.seconds else 0.0

    def text(self) -> str:
        width = max(len(name) for name, _, _ in self.lines)
        rows = [f"  {name:<{width}}  {detail}  {'OK' if ok else 'FAILED'}" for name, detail, ok in self.lines]
        verdict = "exactly-once: OK" if self.ok else "exactly-once: FAILED"
        where = [f"  {'':<{width}}  {self.timeline.text()}"] if self.timeline is not None else []
        return "\n".join(["report", *rows,
                          f"  {'throughput':<{width}}  {self.events_per_s:,.0f} events/s ({self.produced:,} records in "
                          f"{self.seconds:.1f} s, restarts and recovery included)", *where, verdict])


def check(want: Expected, got: Observed, restarts: int, seconds: float, crashed: bool = True) -> Report:
    """Compare the outputs with the expectation, line by line; with ``crashed``, at least one
    restart must have happened."""
    balance_sum = sum(b for b, _ in got.balances.values())
    counted = sum(n for _, n in got.balances.values())
    lost = sum(max(0, n - got.balances.get(a, (0, 0))[1]) for a, (_, n) in want.balances.items())
    repeated = sum(max(0, n - want.balances.get(a, (0, 0))[1]) for a, (_, n) in got.balances.items())
    update_keys = Counter((a, n) for a, n, _ in got.updates)
    twice = sum(c - 1 for c in update_keys.values() if c > 1)
    last: dict[int, tuple[int, int]] = {}
    for account, n, balance in got.updates:
        if n >= last.get(account, (-1, 0))[0]:
            last[account] = (n, balance)
    final_ok = {a: (b, n) for a, (n, b) in last.items()} == want.balances
    totals_diff = sum(1 for k in set(want.totals) | set(got.totals) if want.totals.get(k) != got.totals.get(k))
    lines = [
        ("payments produced", f"{want.produced:,} records ({want.duplicates} upstream duplicates, {want.malformed} malformed)", True),
        ("sum of balances", f"{balance_sum:,} cents == sum of {want.unique:,} unique amounts {want.amount:,}",
         balance_sum == want.amount and got.balances == want.balances),
        ("duplicates", f"{repeated} (payments counted {counted:,}, unique {want.unique:,})", repeated == 0),
        ("losses", f"{lost}", lost == 0 and got.balances == want.balances),
        ("balance updates (Kafka)", f"{len(got.updates):,} read_committed, {twice} repeated, last per account == balance",
         twice == 0 and final_ok),
        ("per-minute totals", f"{len(got.totals):,} (account, minute) rows, {totals_diff} differ", totals_diff == 0),
        ("late events", f"{len(got.late)} (expected {len(want.late)})",
         sorted(got.late) == sorted(want.late)),
        ("dead letters", f"{got.dead_letters} (expected {want.malformed}), {len(got.dead_letter_reasons)} distinct reasons",
         got.dead_letters == want.malformed),
        ("prepared transactions left", f"{got.prepared}", got.prepared == 0),
        ("restarts", f"{restarts} (crash point {CRASH_POINT} at batch {CRASH_BATCH})" if crashed else f"{restarts}",
         restarts >= 1 or not crashed),
    ]
    return Report(lines, restarts, seconds, want.produced)


@contextmanager
def spark_output_to(path: Path) -> Iterator[IO[str]]:
    """Send this process's file descriptors 1 and 2 (which Spark's JVM and Python workers
    inherit) to ``path``; yields the terminal as a text stream for the demo's own lines."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved_out, saved_err = os.dup(1), os.dup(2)
    log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    terminal = os.fdopen(os.dup(saved_out), "w", buffering=1)
    try:
        yield terminal
    finally:
        terminal.flush()
        os.dup2(saved_out, 1)
        os.dup2(saved_err, 2)
        os.close(saved_out)
        os.close(saved_err)
        terminal.close()


class _Progress:
    """Prints a line when something changed, at most every ``every_s`` seconds."""

    def __init__(self, pipeline: ReferencePipeline, out: IO[str], total: int, every_s: float = 2.0) -> None:
        self.pipeline, self.out, self.total, self.every_s = pipeline, out, total, every_s
        self.last_line = ""
        self.last_time = 0.0
        self.started = time.monotonic()

    def __call__(self, queries: list[OncekitQuery]) -> None:
        now = time.monotonic()
        if now - self.last_time < self.every_s:
            return
        self.last_time = now
        try:
            state = self.pipeline.progress()
        except Exception as exc:  # progress is best effort; the queries decide success
            logger.info("progress unavailable: %s", exc)
            return
        running = sum(1 for q in queries if q.isActive)
        line = (f"batches committed {state['checkpoints']:>3} | records {state['records']:>7,}/{self.total:,} | "
                f"prepared txns {state['prepared']:>2} | queries running {running}/{len(queries)}")
        if line != self.last_line:
            print(f"  [{now - self.started:6.1f} s] {line}", file=self.out, flush=True)
            self.last_line = line


def run(pipeline: ReferencePipeline, workload: Workload, out: IO[str], crash: bool = True,
        ui_port: int | None = None) -> Report:
    """Produce, run the prepared ``pipeline`` with one crash and restarts, check. With ``crash``,
    the crash directory must have been in the environment when Spark started in this process (it
    reaches the workers that way). With ``ui_port``, the status page serves on that port until
    the report."""
    with ExitStack() as stack:
        page = stack.enter_context(status_page(pipeline, ui_port, out)) if ui_port is not None else None
        return _run(pipeline, workload, out, crash, page.restarted if page is not None else None)


def _run(pipeline: ReferencePipeline, workload: Workload, out: IO[str], crash: bool,
         on_restart: Callable[[int, BaseException], None] | None) -> Report:
    config = pipeline.config
    require_empty(config)
    started = time.monotonic()
    sent = produce(KafkaConfig(config.kafka_bootstrap()), config.topics.payments, workload)
    print(f"produced {sent:,} payment records to {config.topics.payments} in {time.monotonic() - started:.1f} s "
          f"(seed {workload.seed})", file=out, flush=True)
    want = expected(workload, config.pipeline.allowed_lateness_s)
    if crash:
        crash_points.arm(os.environ[crash_points.CRASH_DIR_ENV], CRASH_POINT, CRASH_BATCH)
    spark = spark_session(SESSION_NAME)
    print(f"pipeline: {len(pipeline.queries(spark))} queries, checkpoints under {pipeline.checkpoint}, restart "
          f"strategy {config.restart_strategy()}", file=out, flush=True)
    if crash:
        print(f"armed crash point {CRASH_POINT} at batch {CRASH_BATCH}: one task will die mid-run", file=out, flush=True)

    def restarted(attempt: int, error: BaseException) -> None:
        text = str(error)
        query = text.split(" failed", 1)[0]
        reason = (f"{query}: a task's Python worker died" if "Python worker exited unexpectedly" in text
                  else text.splitlines()[0][:120])
        print(f"  !! pipeline failed ({reason}); restart {attempt} from the checkpoints", file=out, flush=True)
        if on_restart is not None:
            on_restart(attempt, error)

    progress = _Progress(pipeline, out, sent)
    attempts: list[list[OncekitQuery]] = []

    def tick(queries: list[OncekitQuery]) -> None:
        if not attempts or attempts[-1] is not queries:  # the pipeline started or restarted
            attempts.append(queries)
        progress(queries)

    timeline = Timeline(time.time())

    def failed(attempt: int, error: BaseException) -> None:
        timeline.failures.append(time.time())
        restarted(attempt, error)

    started = time.monotonic()
    restarts = pipeline.run_supervised(lambda: spark, tick=tick, on_restart=failed)
    seconds = time.monotonic() - started
    timeline.ended = time.time()
    timeline.attempts = [[p for q in queries for p in q.recentProgress if int(p["numInputRows"])] for queries in attempts]
    state = pipeline.progress()
    print(f"  done: batches committed {state['checkpoints']}, records {state['records']:,}, "
          f"prepared txns {state['prepared']}", file=out, flush=True)
    report = check(want, observe(config), restarts, seconds, crash)
    report.timeline = timeline
    return report


def main(backend: str | None = None, records: int = 200_000, config_path: str | None = None, seed: int = 7,
         crash: bool = True, ui_port: int | None = None) -> int:
    """``oncekit demo``: returns 0 when every line of the report is OK."""
    workload = demo_workload(records, seed)
    config = load(config_path, {"services.backend": backend,
                                "pipeline.max_offsets_per_trigger": batch_size(workload)})
    work_dir = Path(tempfile.mkdtemp(prefix="oncekit-demo-"))
    # Python workers read the crash directory at import; they inherit it from this environment.
    os.environ[crash_points.CRASH_DIR_ENV] = str(work_dir / "crash")
    print(f"spark log: {work_dir / 'spark.log'}", flush=True)
    with spark_output_to(work_dir / "spark.log") as out:
        spark_start = begin("demo: Spark's start and warm-up", start_spark, config.pipeline)  # while the services start
        started = time.monotonic()
        services = start_services(config.services.backend)
        print(f"services ({services.backend}): kafka {services.kafka.bootstrap_servers}, postgres ready "
              f"({time.monotonic() - started:.1f} s)", file=out, flush=True)
        with services.running():
            pipeline = ReferencePipeline(config.with_services(services.kafka.bootstrap_servers, services.postgres.dsn),
                                         str(work_dir / "checkpoint"))
            started = time.monotonic()
            pipeline.prepare()  # while Spark starts
            print(f"pipeline: topics, tables and sinks prepared in {time.monotonic() - started:.1f} s", file=out, flush=True)
            seconds = spark_start.result(SPARK_START_S)
            print(f"spark: session started and warmed up in {seconds:.1f} s, beside the services", file=out, flush=True)
            report = run(pipeline, workload, out, crash, ui_port)
            print(report.text(), file=out, flush=True)
    return 0 if report.ok else 1


def demo_workload(records: int, seed: int = 7) -> Workload:
    """The demo's payments: ``records`` of them over 50 accounts, with upstream duplicates, late
    and malformed records."""
    return Workload(count=records, accounts=50, duplicates=0.01, late=0.02, malformed=0.005, seed=seed)


def batch_size(workload: Workload) -> int:
    """The demo's records per batch: four batches, so that the crash at batch 1 falls mid-run.
    The topic holds the workload's records and its upstream duplicates (about ``duplicates`` of
    them, drawn at random: 1% is left for the draw), and a fifth batch of a few records would
    cost a batch's fixed time for nothing."""
    return max(500, math.ceil(workload.count * (1 + workload.duplicates) * 1.01 / 4))


SPARK_START_S = 600.0
"""How long the demo waits for its Spark session's start and warm-up."""

SPARK_CONF = {"spark.driver.extraJavaOptions": "-XX:TieredStopAtLevel=1"}
"""The demo's session: its JVM compiles with C1 only. The demo's pipeline runs about 20 s, and
C2's compiles of Spark's code would take a third of the JVM's CPU in that time (13.5 of 40 CPU
seconds on two cores, measured per JVM thread) while the pipeline's own tasks wait for cores;
C1 alone gave a first batch of 4.5-5.4 s (nine runs) against 5.6-7.6 s (five). A job that runs for minutes or
more keeps the JVM's default (tiered, C2 for hot code): C2's code then pays for its compiles
(1,000,000 records of the reference pipeline: 34,169-34,934 events/s tiered, 29,380 C1 only)."""


def start_spark(run: RunConfig) -> float:
    """The demo's Spark session (:data:`SPARK_CONF`) started and warmed up for the pipeline with
    ``run``'s settings (:meth:`ReferencePipeline.warm_up`: Spark's Python processes started, the
    kit's modules imported, the pipeline's plan run once on made-up records); returns the seconds
    it took.
    :func:`main` runs it on a thread of its own (:func:`~oncekit.core.deadline.begin`) while the
    services start: neither needs the other, and the first batch no longer pays for it. The
    crash directory must be in the environment by then (Spark's processes inherit it)."""
    started = time.monotonic()
    ReferencePipeline.warm_up(spark_session(SESSION_NAME, conf=SPARK_CONF), run)
    return time.monotonic() - started

"""The soak behind ``oncekit verify --soak 30m``: one pipeline for a long run, input at a steady
rate, a fault about every minute, and what must stay bounded sampled every few minutes.

It runs on the campaign's machinery (:class:`~oncekit.verify.campaign.Campaign`: the driver
process, its restarts, the output readers, fault injection) and the campaign's fault schedule
(:func:`~oncekit.verify.faults.schedule`). Each sample is a row: records in and out, duplicates,
losses, the driver's, the JVM's and the Python workers' resident memory, the checkpoint folder's
size, journal entries, staged files, the kit's rows beside the target (marker rows, recorded
checkpoints), marker partitions, prepared transactions. After the run the input stops, the output
must catch up, and the last row is taken; :func:`unbounded` names what grew past its bound.

The input stops while a fault is being injected (at most a few seconds) and catches up right
after, so the rate holds on average. Losses in a row are records missing from the output though
they sit below the input offsets of the newest batch the kit's journal marks done (every sink
committed it and everything before it) and, for a topic, though the broker has written the
commit markers of every transaction committed before the row (waited for up to ``MARKERS_S``);
records not yet there are in flight. The last row's losses are the records missing once the
output had every chance to catch up.
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Hashable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psycopg
from confluent_kafka import KafkaException

from oncekit.connectors import Services
from oncekit.core.crash import POINTS, arm, disarm, fired_at
from oncekit.core.errors import ConfigError
from oncekit.core.stalls import StallLog
from oncekit.verify.memory import driver_memory
from oncekit.verify.campaign import Campaign
from oncekit.verify.examples import EXAMPLES
from oncekit.verify.faults import SERVICE_FAULTS, Fault, schedule
from oncekit.verify.io import KafkaOutput, kit_rows, marker_partitions, prepared_transactions, produce_input

logger = logging.getLogger(__name__)

SPARK_RETAIN = 100  # spark.sql.streaming.minBatchesToRetain's default: the commits Spark keeps
PER_BATCH = 2000  # a batch's cap: well above the rate times a batch's duration, so a restart's backlog clears
MARKERS_S = 60.0  # a row waits this long for the output topic's commit markers before it counts a loss


def parse_duration(text: str) -> float:
    """``90s``, ``3m``, ``1h`` or plain seconds, as seconds."""
    units = {"s": 1, "m": 60, "h": 3600}
    number, unit = (text[:-1], text[-1]) if text and text[-1] in units else (text, "s")
    try:
        seconds = float(number) * units[unit]
    except ValueError as exc:
        raise ConfigError(f"soak duration {text!r}: give seconds or a number with s, m or h (30m)") from exc
    if seconds <= 0:
        raise ConfigError(f"soak duration {text!r} must be positive")
    return seconds


GAUGE_WAIT_S = 120.0
"""How long a sample reads a gauge again while its service is down (a fault the soak injected:
a restart takes seconds, a network cut its length)."""


def when_reachable(read: Callable[[], int], wait_s: float = GAUGE_WAIT_S, pause_s: float = 0.5) -> int:
    """``read()`` of a gauge in PostgreSQL or Kafka, again while its service is unreachable (a
    fault in progress, or a connection it broke), for up to ``wait_s``; then its error. Called
    by :meth:`Soak.sample`."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return read()
        except (psycopg.OperationalError, KafkaException) as exc:
            if time.monotonic() > deadline:
                raise
            logger.info("soak: a gauge is unreadable for now (%s); reading it again", exc)
            time.sleep(pause_s)


@dataclass(frozen=True)
class SoakSample:
    """One row of the soak's table."""

    elapsed_s: float
    faults: int              # injected so far
    records_in: int          # produced (upstream duplicates count twice, as the output must)
    records_out: int         # committed in the output
    duplicates: int          # output records beyond what the input holds
    losses: int              # missing, though a batch the journal marks done read them
    in_flight: int           # missing, not yet read by such a batch
    batches: int | None      # the latest batch Spark completed
    driver_rss_mb: float     # the driver's Python process
    jvm_rss_mb: float        # Spark's JVM (driver and executor in local mode)
    workers_rss_mb: float    # the JVM's Python workers (tasks, driver-side commits)
    checkpoint_kb: float     # every file under the query's checkpoint
    checkpoint_files: int
    journal_entries: int     # <batch>.json files of the kit's journals
    staged: int              # files and folders under the kit's staging folders
    kit_rows: int            # marker rows and recorded checkpoints in PostgreSQL
    marker_partitions: int   # partitions of the Kafka sinks' marker topics
    prepared: int            # prepared transactions of the pipeline's sinks
    stalls: int = 0          # batches the driver's batch watchdog stopped as stalled, so far


@dataclass(frozen=True)
class SoakReport:
    pipeline: str
    seed: int
    duration_s: float
    rate: float
    retain: int
    samples: list[SoakSample]
    faults: list[tuple[str, bool]]  # (fault, fired)
    final: str                      # the multiset verdict over all input, after the drain
    left_behind: list[str]
    problems: list[str] = field(default_factory=list)  # what grew past its bound

    @property
    def passed(self) -> bool:
        return self.final == "exactly-once" and not self.left_behind and not self.problems


HEADER = ("| min | faults | in | out | dup | lost | in flight | batch | driver MB | JVM MB | workers MB | "
          "checkpoint KB | files | journal | staged | kit rows | marker partitions | prepared | stalls |")


def row(sample: SoakSample) -> str:
    s = sample
    return (f"| {s.elapsed_s / 60:5.1f} | {s.faults:>3} | {s.records_in:>7,} | {s.records_out:>7,} | {s.duplicates} | "
            f"{s.losses} | {s.in_flight:>5} | {'' if s.batches is None else s.batches:>5} | {s.driver_rss_mb:6.0f} | "
            f"{s.jvm_rss_mb:6.0f} | {s.workers_rss_mb:6.0f} | {s.checkpoint_kb:8.0f} | {s.checkpoint_files:>5} | "
            f"{s.journal_entries:>3} | {s.staged:>3} | {s.kit_rows:>4} | {s.marker_partitions:>3} | {s.prepared:>3} | "
            f"{s.stalls:>2} |")


def table(report: SoakReport) -> str:
    """The soak as Markdown: its rows (the last one after the drain), the faults, the verdict."""
    lines = [f"oncekit verify --soak: pipeline {report.pipeline}, {report.duration_s / 60:.1f} min at "
             f"{report.rate:g} records/s, seed {report.seed}, Spark keeps {report.retain} batches",
             HEADER, "|" + "---|" * (HEADER.count("|") - 1),
             *(row(s) for s in report.samples),
             "faults: " + "; ".join(f"{f}{'' if fired else ' (did not fire)'}" for f, fired in report.faults),
             f"final: {report.final}; left behind: {', '.join(report.left_behind) or 'nothing'}; "
             f"bounds: {'; '.join(report.problems) or 'all held'}"]
    return "\n".join(lines)


def unbounded(samples: list[SoakSample], retain: int, partitions: int = 2) -> list[str]:
    """What grew past its bound. The journal keeps what Spark keeps (``retain`` completed
    batches) plus the batches in flight; staged files and prepared transactions belong to batches
    in flight only; the kit's rows to the batches the journal keeps; one marker partition per sink and
    writing partition; the checkpoint folder stops growing once Spark purges its logs. Memory is
    reported, not judged here (a JVM grows its heap lazily up to its maximum)."""
    problems = []
    in_flight = 3  # batches: the running one, one being committed, one a restart re-runs
    limits = {  # field: bound
        "journal_entries": retain + in_flight + 2,
        "staged": in_flight * (2 * partitions + 1),
        "prepared": in_flight * partitions * 2,
        "kit_rows": (retain + in_flight + 2) * partitions * 2,
        "marker_partitions": partitions + 1,
        "stalls": 0,  # live: a batch never waits out the batch timeout
    }
    for name, limit in limits.items():
        worst = max(samples, key=lambda s: float(getattr(s, name)))
        if getattr(worst, name) > limit:
            problems.append(f"{name.replace('_', ' ')} {getattr(worst, name)} > {limit} at {worst.elapsed_s / 60:.1f} min")
    half = [s for s in samples if s.elapsed_s <= samples[-1].elapsed_s / 2]
    if len(half) >= 2:
        early = max(s.checkpoint_kb for s in half)
        late = max(s.checkpoint_kb for s in samples)
        if late > 1.5 * early + 64:
            problems.append(f"checkpoint folder {late:.0f} KB, {early:.0f} KB in the first half")
    return problems


class Soak:
    """One soak: the campaign's pipeline and driver, input at ``rate``, a fault every
    ``fault_every_s``, a sample every ``sample_every_s``. Called by :func:`run_soak`."""

    def __init__(self, campaign: Campaign, rate: float) -> None:
        self.campaign, self.rate = campaign, rate
        self.started = time.monotonic()
        self.input = KafkaOutput(campaign.kafka, campaign.ctx.input_topic)  # (partition, offset) of each id
        self.faults: list[tuple[Fault, bool]] = []
        self.armed: Fault | None = None

    def produce(self, now: float) -> None:
        """The records due at ``rate`` since the start, in one transaction."""
        due = int((now - self.started) * self.rate) - self.campaign.produced
        if due <= 0:
            return
        first = self.campaign.produced
        self.campaign.expected += produce_input(self.campaign.kafka, self.campaign.ctx.input_topic, due, first=first,
                                                upstream=self.campaign.upstream)
        self.campaign.produced += due

    def inject(self, fault: Fault) -> None:
        """Inject ``fault`` now (a crash point: armed for the next batch, seen to fire later)."""
        self.settle_crash()
        if fault.kind == "crash":
            arm(self.campaign.crash_dir, fault.point or "", (self.campaign.batch_in_flight() or 0) + 1)
            self.armed = fault
        else:
            self.campaign.inject(fault)
            self.faults.append((fault, True))
        logger.info("soak: %s", fault)

    def settle_crash(self) -> None:
        """Record whether the crash point armed last fired; disarm it if not."""
        if self.armed is None:
            return
        fired = fired_at(self.campaign.crash_dir, self.armed.point or "") is not None
        if not fired:
            disarm(self.campaign.crash_dir, self.armed.point or "")
        self.faults.append((self.armed, fired))
        self.armed = None

    def drain(self, deadline_s: float) -> None:
        """No more input: wait until the output holds all of it and Spark is idle, and a little
        longer, so that late duplicates would show; or until ``deadline_s``."""
        want = Counter(self.campaign.wanted())
        deadline, settled = time.monotonic() + deadline_s, None
        while time.monotonic() < deadline:
            self.campaign.driver.ensure_running()
            got = self.campaign.observe()
            if got is not None and not (want - Counter(got)) and self.campaign.idle():
                settled = settled or time.monotonic()
                if time.monotonic() - settled > 3.0:
                    return
            else:
                settled = None
            time.sleep(0.5)

    def sample(self, final: bool = False) -> SoakSample:
        campaign = self.campaign
        now = time.monotonic()
        read = self._read_by_done_batch()  # before the output: what it shows must then be there
        want = Counter(campaign.wanted())

        def observed() -> tuple[list[Hashable], Counter[Hashable], int]:
            got = self._observe_all()
            missing = want - Counter(got)
            old = sum(missing.values()) if final else sum(min(n, read[_id_of(key)]) for key, n in missing.items())
            return got, missing, old

        got, missing, old = observed()
        if old and not final and campaign.kafka_output is not None:
            # Done means committed, not yet readable: the broker writes a transaction's commit
            # markers after the producer's commit returns (seen 12-25 s late after a broker
            # restart). Missing records count as lost once the markers are written.
            stable = campaign.kafka_output.await_stable(MARKERS_S)
            logger.info("soak: %s records of done batches not yet visible; commit markers %s", old,
                        "written" if stable else f"still pending after {MARKERS_S:.0f} s")
            got, missing, old = observed()
        have = Counter(got)
        driver, jvm, workers = driver_memory(campaign.driver.process.pid if campaign.driver.process else None)
        checkpoint = Path(campaign.ctx.checkpoint)
        files = [p for p in checkpoint.rglob("*") if p.is_file()] if checkpoint.exists() else []
        kit = checkpoint / "oncekit"
        output = campaign.ctx.output
        if final:
            self.input.__exit__()
        return SoakSample(
            elapsed_s=round(now - self.started, 1),
            faults=len(self.faults) + (self.armed is not None),
            records_in=len(campaign.expected) * (2 if campaign.kind == "fan-out" else 1),
            records_out=len(got), duplicates=sum((have - want).values()),
            losses=old, in_flight=sum(missing.values()) - old,
            batches=campaign.batch_committed(),
            driver_rss_mb=driver, jvm_rss_mb=jvm, workers_rss_mb=workers,
            checkpoint_kb=round(sum(_size(p) for p in files) / 1024, 1), checkpoint_files=len(files),
            journal_entries=len(list(kit.glob("*/journal/*.json"))),
            staged=len(list(kit.glob("*/staged/**/*"))),
            kit_rows=when_reachable(lambda: kit_rows(campaign.services.postgres.dsn, output))
            if campaign.kind != "kafka" else 0,
            marker_partitions=when_reachable(lambda: marker_partitions(campaign.kafka, output))
            if campaign.kind != "postgres" else 0,
            prepared=when_reachable(lambda: len(prepared_transactions(campaign.services.postgres.dsn, output))),
            stalls=StallLog(campaign.ctx.checkpoint).read()[0],
        )


    def _observe_all(self) -> list[Hashable]:
        """The output, read until a read brings nothing new (a topic's read returns at most a
        thousand new records)."""
        got: list[Hashable] | None = None
        for _ in range(100):
            again = self.campaign.observe()
            if again is None:  # a service being faulted: read it again
                time.sleep(0.5)
                continue
            if got is not None and len(again) == len(got):
                break
            got = again
        return got if got is not None else self.campaign.output()

    def _read_by_done_batch(self) -> Counter[int]:
        """How often each input id sits below the end offsets of the newest batch a journal of the
        query marks done."""
        journals = Path(self.campaign.ctx.checkpoint) / "oncekit"
        done = [int(p.stem) for p in journals.glob("*/journal/*.done") if p.stem.isdigit()]
        if not done:
            return Counter()
        try:
            ends = self.campaign.spark_log.source_offsets(max(done))[0][self.campaign.ctx.input_topic]
        except (OSError, LookupError, TypeError, ValueError):
            return Counter()  # pruned meanwhile: the next row judges
        before = -1
        for _ in range(100):  # a read returns at most a thousand new records: read until nothing new comes
            if len(self.input.records) == before:
                break
            before = len(self.input.records)
            self.input.read(0.5)
        return Counter(int(value) for (partition, offset), value in self.input.records.items()
                       if offset < int(ends.get(str(partition), 0)) and value.lstrip(b"-").isdigit())


def periodic_faults(text: str) -> list[tuple[float, Fault]]:
    """``kafka-restart=120,postgres-restart=300``: each service fault kind (3 s down) and how
    often, in seconds; ConfigError for anything else."""
    out = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        kind, _, every = item.partition("=")
        if kind not in SERVICE_FAULTS:
            raise ConfigError(f"periodic fault {item!r}: the kind must be one of {', '.join(SERVICE_FAULTS)}")
        try:
            out.append((float(every), Fault(kind, outage_s=3.0)))
        except ValueError as exc:
            raise ConfigError(f"periodic fault {item!r}: give kind=seconds, as kafka-restart=120") from exc
    return out


def run_soak(pipeline: str, services: Services, duration_s: float, seed: int = 1, rate: float = 10.0,
             fault_every_s: float = 60.0, sample_every_s: float = 180.0, retain: int | None = None,
             progress: Callable[[SoakSample], None] | None = None, env: dict[str, str] | None = None,
             work_dir: str | None = None, per_batch: int = PER_BATCH, drain_s: float = 600.0,
             periodic: list[tuple[float, Fault]] | None = None) -> SoakReport:
    """Soak ``pipeline`` for ``duration_s`` (see the module docstring). ``retain`` lowers Spark's
    ``minBatchesToRetain`` for the driver (a short soak reaches the purge that way); ``progress``
    hears every sample as it is taken; ``drain_s`` bounds the wait for the output to catch up
    once the input stops. ``periodic`` (every so many seconds, a fault) replaces the drawn
    schedule (a fault every ``fault_every_s``)."""
    example = EXAMPLES.get(pipeline)
    env = dict(env or {})
    if retain is not None:
        env["PYSPARK_SUBMIT_ARGS"] = f"--conf spark.sql.streaming.minBatchesToRetain={retain} pyspark-shell"
    if periodic:  # (when, fault) in time order
        plan = sorted(((every * n, fault) for every, fault in periodic for n in range(1, int(duration_s // every) + 1)),
                      key=lambda pair: pair[0])
    else:
        drawn = schedule(seed, max(1, int(duration_s // fault_every_s)), example.points if example else POINTS,
                         network_cuts=services.backend == "containers")
        plan = [(fault_every_s * (n + 1), fault) for n, fault in enumerate(drawn)]
    name = f"soak-{pipeline.replace(':', '-').replace('.', '-')}-{seed}-{time.time_ns() % 10**9}"
    samples: list[SoakSample] = []

    def take(final: bool = False) -> None:
        samples.append(soak.sample(final))
        if progress is not None:
            progress(samples[-1])

    with tempfile.TemporaryDirectory(prefix="oncekit-soak-") as temporary:
        work = Path(work_dir or temporary)
        work.mkdir(parents=True, exist_ok=True)
        campaign = Campaign(pipeline, services, name, work, per_batch=per_batch, env=env)
        try:
            campaign.driver.ensure_running()
            soak = Soak(campaign, rate)
            next_sample = sample_every_s
            while (elapsed := time.monotonic() - soak.started) < duration_s:
                soak.produce(time.monotonic())
                campaign.driver.ensure_running()
                if plan and elapsed >= plan[0][0]:
                    soak.inject(plan.pop(0)[1])
                if elapsed >= next_sample:
                    take()
                    next_sample += sample_every_s
                time.sleep(0.5)
            soak.settle_crash()
            soak.drain(drain_s)
            take(final=True)
        finally:
            code, verdict, left = campaign.finish()
        if code not in (0, None):
            left.append(f"driver exited with {code} when stopped")
    effective = retain if retain is not None else SPARK_RETAIN
    return SoakReport(pipeline, seed, duration_s, rate, effective, samples,
                      [(str(f), fired) for f, fired in soak.faults], verdict.name, left,
                      unbounded(samples, effective))


def _id_of(key: Hashable) -> int:
    return int(key[1] if isinstance(key, tuple) else key)  # type: ignore[arg-type]


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:  # Spark purged it meanwhile
        return 0


def report_dict(report: SoakReport) -> dict[str, object]:
    """The report as JSON-ready data, with the pass verdict."""
    return {**asdict(report), "passed": report.passed}

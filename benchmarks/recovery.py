"""7. Recovery: kill -9 of a Kafka -> Kafka query's driver at a steady input rate, and where the
seconds go until its successor has committed a batch and caught up (issue 23 item 1).

Each case runs its query in a driver process of its own (``python -m oncekit.verify`` with one of
the pipelines below), input produced at ``--rate`` records a second throughout. When the query
is committing, the driver's process group is killed and a new driver started at once, as a
supervisor with no restart delay would; ``--kills`` times. With a standby, a second driver
process (:func:`oncekit.core.spark.standby.stand_by`) is started and warmed up before each kill,
takes over, and, when another kill follows, the next standby starts once it has caught up. Every
step is read afterwards from what the processes leave: the driver's timeline
(:class:`~oncekit.verify.driver.Timeline`), the kit's journal and Spark's offset and commit logs.
Seconds from the kill:

- process: the new driver's Python runs its main (imports done);
- session: Spark's session is up (its JVM started);
- takeover: the standby found the lease free; none without a standby;
- query: the query started (``start_query`` or ``start()`` returned);
- recovered: the kit's sink recovered (the journal records the run); none for the peer;
- planned: the first batch after the kill is planned (its offset log entry; a batch the dead
  driver planned is replayed as planned, at the query's start);
- committed: Spark logs the first batch after the kill as committed;
- caught up: Spark logs a batch whose end offsets reach what the input held at the kill.
"""

from __future__ import annotations

import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, TopicPartition

from benchmarks import data, peers
from benchmarks.cases import failure
from benchmarks.environment import Bench
from benchmarks.table import Ratio, Row, Table
from oncekit.connectors.kafka_admin import create_topic
from oncekit.core.spark.query import Trigger
from oncekit.core.spark_log import SparkLog
from oncekit.verify.driver import Timeline, start_driver, wait_step
from oncekit.verify.examples import PipelineContext

STEPS = ("process", "session", "takeover", "query", "recovered", "planned", "committed", "caught up")
TRIGGER = Trigger(processing_time="1 second")
STEADY_BATCHES = 3  # batches committed after catching up before the next kill
RECOVERY_DEADLINE_S = 180.0


def kit_pipeline(spark: Any, ctx: PipelineContext) -> Any:
    """The kit's source into its transactional Kafka sink (a driver process runs it)."""
    from oncekit.core.spark.query import start_query
    from oncekit.sinks.kafka import kafka_sink
    from oncekit.sources.kafka import kafka_stream

    return start_query(kafka_stream(spark, ctx.bootstrap_servers, ctx.input_topic).select("key", "value"),
                       kafka_sink(ctx.bootstrap_servers, ctx.output, "transactional"), ctx.checkpoint,
                       trigger=ctx.trigger)


def spark_pipeline(spark: Any, ctx: PipelineContext) -> Any:
    """Spark's JVM Kafka source into its Kafka sink, the peer (its jars come by PYSPARK_SUBMIT_ARGS)."""
    frame = peers.spark_kafka_stream(spark, ctx.bootstrap_servers, ctx.input_topic)
    return (peers.spark_kafka_sink(frame, ctx.bootstrap_servers, ctx.output)
            .option("checkpointLocation", ctx.checkpoint).trigger(**ctx.trigger.keywords()).start())


def input_end(bench: Bench, topic: str) -> int:
    """Records in ``topic`` now (a plain producer writes it: offsets are records)."""
    consumer = Consumer(bench.kafka.consumer_settings(group_id="bench-recovery-marks"))
    try:
        partitions = consumer.list_topics(topic, timeout=30).topics[topic].partitions
        return sum(consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30)[1] for p in partitions)
    finally:
        consumer.close()


def end_offset(spark_log: SparkLog, batch_id: int, topic: str) -> int:
    (offsets, *_) = spark_log.source_offsets(batch_id)
    return sum(int(v) for v in (offsets or {}).get(topic, {}).values())


def file_times(folder: Path) -> dict[int, float]:
    return {int(p.name): p.stat().st_mtime for p in folder.glob("[0-9]*") if p.name.isdigit()} if folder.exists() else {}


class Case:
    """One pipeline's driver, its input producer and the restarts measured on it."""

    def __init__(self, bench: Bench, name: str, pipeline: str, env: dict[str, str], work: Path,
                 standby: bool = False, standby_prefix: tuple[str, ...] = ()) -> None:
        self.bench, self.name, self.pipeline, self.env = bench, name, pipeline, env
        self.standby_prefix = standby_prefix
        tag = "".join(c if c.isalnum() else "_" for c in name.lower())
        self.source, output = f"bench_recovery_{tag}_in", f"bench_recovery_{tag}_out"
        for topic in (self.source, output):
            create_topic(bench.kafka, topic, partitions=bench.options.partitions)
        self.ctx = PipelineContext(bench.servers, self.source, output, str(work / tag / "checkpoint"), trigger=TRIGGER)
        self.log, self.crash_dir = work / tag / "driver.log", work / tag / "crash"
        self.crash_dir.mkdir(parents=True)
        self.spark_log = SparkLog(self.ctx.checkpoint)
        self.timeline = Timeline(self.ctx.checkpoint)
        self.driver = self._start()
        self.with_standby = standby
        self.standby = self._start_standby() if standby else None

    def _start(self, standby: bool = False) -> Any:
        return start_driver(self.pipeline, self.ctx, str(self.crash_dir), log=self.log, env=self.env, standby=standby,
                            prefix=self.standby_prefix if standby else ())

    def _start_standby(self) -> Any:
        """A standby driver, once it has warmed up."""
        process = self._start(standby=True)
        wait_step(process, self.ctx.checkpoint, "warm", RECOVERY_DEADLINE_S, f"{self.name} standby, log {self.log}")
        return process

    def wait_committed(self, after: int, deadline_s: float = RECOVERY_DEADLINE_S) -> int:
        """Wait until Spark logs a batch above ``after``; returns the newest."""
        deadline = time.monotonic() + deadline_s
        while True:
            latest = self.spark_log.latest_completed()
            if latest is not None and latest > after:
                return latest
            if self.driver.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: no batch above {after} committed (driver exit {self.driver.poll()}); "
                                   f"see {self.log}")
            time.sleep(0.1)

    def kill_and_restart(self, again: bool) -> dict[str, float]:
        """Kill -9 the driver, start the next one at once, and return the seconds of each step;
        with a standby, a new standby warms up when another kill follows (``again``)."""
        killed_at_end = input_end(self.bench, self.source)
        before = self.spark_log.latest_completed()
        killed = time.time()
        os.killpg(self.driver.pid, signal.SIGKILL)
        self.driver.wait()
        if self.standby is None:
            self.driver = self._start()
        else:
            self.driver, self.standby = self.standby, None
        last = before if before is not None else -1
        while True:  # until a batch after the kill covers the input the kill left
            newest = self.wait_committed(last)
            covering = next((b for b in range(last + 1, newest + 1)
                             if end_offset(self.spark_log, b, self.source) >= killed_at_end), None)
            if covering is not None:
                break
            last = newest
        steps = self._steps(killed, covering)
        if self.with_standby and again:
            self.standby = self._start_standby()
        return steps

    def _steps(self, killed: float, covering: int) -> dict[str, float]:
        """Seconds from ``killed`` to each step; ``covering`` is the first batch that caught up."""
        root = Path(self.ctx.checkpoint)
        committed = {b: t for b, t in file_times(root / "commits").items() if t > killed}
        planned = file_times(root / "offsets")
        marks = {e["step"]: e["t"] for e in self.timeline.read() if e["t"] > killed}
        first = min(committed)
        steps = {step: marks[step] - killed for step in ("process", "session", "takeover", "query") if step in marks}
        runs = [p.stat().st_mtime for p in (root / "oncekit").glob("*/journal/run")]
        if runs and max(runs) > killed:
            steps["recovered"] = max(runs) - killed
        steps["planned"] = (planned[first] if planned.get(first, 0.0) > killed else marks.get("query", killed)) - killed
        steps["committed"] = committed[first] - killed
        steps["caught up"] = committed[covering] - killed
        return steps

    def close(self) -> None:
        for process in (self.driver, self.standby):
            if process is not None and process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def measure(bench: Bench, name: str, pipeline: str, env: dict[str, str], kills: int, standby: bool = False,
            standby_prefix: tuple[str, ...] = ()) -> list[Row]:
    options = bench.options
    print(f"  {name}: {kills} kills at {options.rate:,} records/s", file=sys.stderr, flush=True)
    stop = threading.Event()
    with tempfile.TemporaryDirectory() as work:
        try:
            case = Case(bench, name, pipeline, env, Path(work), standby, standby_prefix)
        except Exception as exc:  # the other case still runs
            return [Row.failed(f"{name} median", failure(exc))]
        producer = threading.Thread(target=data.produce_at_rate, daemon=True, args=(
            bench.kafka, case.source, options.rate, 24 * 3600.0, options.record_bytes, options.partitions, stop))
        producer.start()
        restarts: list[dict[str, float]] = []
        try:
            latest = case.wait_committed(-1)
            for kill in range(1, kills + 1):
                latest = case.wait_committed(latest + STEADY_BATCHES - 1)
                restarts.append(case.kill_and_restart(again=kill < kills))
                latest = case.spark_log.latest_completed() or 0
        except Exception as exc:
            return [Row.failed(f"{name} median", failure(exc))]
        finally:
            stop.set()
            case.close()
            producer.join(60)
    rows = []
    for label, figure in labelled(kills):
        figures = {step: figure([r[step] for r in restarts if step in r]) for step in STEPS
                   if any(step in r for r in restarts)}
        rows.append(Row(f"{name}{label}", figures, f"{len(restarts)} restart{'s' if len(restarts) > 1 else ''}"))
    return rows


def labelled(kills: int) -> list[tuple[str, Callable[[list[float]], float]]]:
    """The rows of a case: its one restart, or the median and maximum of its restarts."""
    if kills == 1:
        return [("", statistics.median)]
    return [(" median", statistics.median), (" max", max)]


def recovery_group(bench: Bench) -> Table:
    options = bench.options
    kit, standby, peer = "kit transactional", "kit transactional, standby", "Spark Kafka source and sink"
    remote = "kit transactional, standby on another host"
    print("7. Recovery", file=sys.stderr, flush=True)
    table = Table(
        f"7. Recovery after kill -9 of the driver: {options.rate:,} records/s, {options.partitions} partitions, "
        f"processingTime 1 second, {options.kills} kills each; seconds from the kill",
        STEPS, ("committed", "caught up"), "recovery time; below 1 the kit recovers faster",
        ratios=[Ratio(f"{case}{label}", f"{peer}{label}")
                for case in (kit, standby, remote) for label, _ in labelled(options.kills)],
        notes=["A new driver process starts right after each kill (local[2,4], the driver's Spark session and "
               "query from nothing); with a standby, the warmed-up standby takes over and, when another kill follows, "
               "the next standby starts once it has caught up. A standby on another host runs in a pid namespace of "
               "its own (unshare --pid --fork --mount-proc), so it cannot see the active driver's process go and "
               "waits for the lease's expiry (the default, ONCEKIT_LEASE_EXPIRY_S). " + bench.connector.describe()
               + ". Steps: see benchmarks/recovery.py."])
    jars = {"PYSPARK_SUBMIT_ARGS": f"--jars {','.join(bench.connector.jars)} pyspark-shell"}
    table.rows += measure(bench, kit, "benchmarks.recovery:kit_pipeline", {}, options.kills)
    table.rows += measure(bench, standby, "benchmarks.recovery:kit_pipeline", {}, options.kills, standby=True)
    table.rows += measure(bench, remote, "benchmarks.recovery:kit_pipeline", {}, options.kills, standby=True,
                          standby_prefix=("unshare", "--pid", "--fork", "--mount-proc"))
    table.rows += measure(bench, peer, "benchmarks.recovery:spark_pipeline", jars, options.kills)
    return table

"""``oncekit verify --lifecycle``: what months of running do to a pipeline, one case each, against
a real broker started with ``offsets.retention.minutes=1`` (issue 21). Every case ends
exactly-once, or in the refusal it names; the table shows case, expected and seen.

- markers outlive offsets retention: a transactional batch half committed, the pipeline down
  until the broker has expired a consumer group's offsets, then restarted; a second checkpoint
  on the sink id is still refused (the owner record survived too);
- speculation: a driver started with ``--conf spark.speculation=true`` is refused at start;
- replay with another partitioning: a half-committed batch replayed by a plan with other
  partitions is refused at start, and the earlier plan finishes it;
- slow upstream: a partition whose input takes longer than the transaction timeout commits;
- savepoints and a live query: ``savepoint create`` of a query another process runs is
  refused, and so is a restored savepoint's start while its original runs.

Called by ``oncekit verify --lifecycle`` (:func:`oncekit.verify.command.lifecycle`) and by the
test suite, each with its own Spark session (crash points armed in ``crash_dir``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, ConsumerGroupTopicPartitions, TopicPartition
from confluent_kafka.admin import AdminClient

from oncekit.connectors import KafkaConfig
from oncekit.connectors.kafka_admin import create_topic
from oncekit.connectors.wait import wait_until
from oncekit.core import savepoint as savepoints
from oncekit.core.crash import arm, fired_at
from oncekit.core.errors import SavepointError, VerifyError
from oncekit.core.lease import QueryLease
from oncekit.core.protocol import SinkConfig
from oncekit.core.spark.query import Trigger, start_query
from oncekit.core.spark_log import SparkLog
from oncekit.verify.checker import compare
from oncekit.verify.driver import DriverProcess, start_driver
from oncekit.verify.examples import COUNT, PER_BATCH, PipelineContext, integers, start_example
from oncekit.verify.io import produce_input, read_committed

logger = logging.getLogger(__name__)

BROKER_SETTINGS = {"offsets.retention.minutes": "1", "offsets.retention.check.interval.ms": "2000"}
"""The lifecycle campaign's broker: a consumer group's offsets expire a minute after their commit."""
EXPIRY_S = 180.0
SLOW_ROW_S = 0.1  # the slow upstream: 150 rows a partition take 15 s, under a 6 s transaction timeout
SLOW_TIMEOUT_MS = 6_000


@dataclass(frozen=True)
class LifecycleResult:
    case: str
    expected: str
    seen: str
    passed: bool


class Lifecycle:
    """The lifecycle cases on ``kafka`` (a broker with :data:`BROKER_SETTINGS`), in ``spark``,
    with scratch folders under ``work``."""

    def __init__(self, spark: Any, kafka: KafkaConfig, work: Path, crash_dir: Path) -> None:
        self.spark, self.kafka, self.work, self.crash_dir = spark, kafka, work, crash_dir

    def run(self, progress: Callable[[LifecycleResult], None] = lambda result: None) -> list[LifecycleResult]:
        cases: list[tuple[str, str, Callable[[], tuple[str, bool]]]] = [
            ("1 markers outlive offsets retention", "exactly-once; second checkpoint refused", self.markers_outlive_retention),
            ("3 speculation", "refused at start", self.speculation),
            ("5 replay with another partitioning", "refused at start; then exactly-once", self.replay_partitioning),
            ("6 slow upstream", "exactly-once", self.slow_upstream),
            ("9 savepoints and a live query", "create refused; restored start refused", self.savepoint_live),
        ]
        results = []
        for name, expected, case in cases:
            try:
                seen, passed = case()
            except Exception as exc:  # noqa: BLE001 - a case that breaks is a failed row, not a lost table
                logger.exception("lifecycle case %s", name)
                seen, passed = f"{type(exc).__name__}: {_first_line(exc)}", False
            results.append(LifecycleResult(name, expected, seen, passed))
            progress(results[-1])
        return results

    # -- helpers -----------------------------------------------------------------------------

    def _topics(self, case: str, count: int = COUNT) -> tuple[str, str, list[int]]:
        topic = f"lifecycle-{case}-{uuid.uuid4().hex[:8]}"
        for name in (topic, f"{topic}-out"):
            create_topic(self.kafka, name, partitions=2)
        expected = produce_input(self.kafka, topic, count)
        return topic, f"{topic}-out", expected

    def _sink(self, out: str, **options: Any) -> SinkConfig:
        from oncekit.sinks.kafka import kafka_sink

        return kafka_sink(self.kafka.bootstrap_servers, out, "transactional", client=dict(self.kafka.client), **options)

    def _frame(self, topic: str, partitions: int | None = None) -> Any:
        frame = integers(self.spark, self.kafka, topic, PER_BATCH)
        if partitions is not None:
            frame = frame.repartition(partitions, "id")
        return frame.selectExpr("CAST(id AS STRING) AS key", "CAST(id AS STRING) AS value")

    def _drain(self, frame: Any, sink: SinkConfig, checkpoint: Path) -> None:
        start_query(frame, sink, str(checkpoint), trigger=Trigger(available_now=True), notify=False).await_termination()

    def _crashed(self, frame: Any, sink: SinkConfig, checkpoint: Path, partition: int) -> None:
        """Run until batch 1's task of ``partition`` has committed and its worker died."""
        arm(self.crash_dir, "task_after_pre_commit", batch_id=1, partition_id=partition)
        try:
            self._drain(frame, sink, checkpoint)
        except Exception as exc:  # noqa: BLE001 - the crash fails the query
            logger.info("lifecycle: the query failed as the crash point meant: %s", _first_line(exc))
        if fired_at(self.crash_dir, "task_after_pre_commit") is None:
            raise VerifyError("the crash point task_after_pre_commit did not fire")

    def _verdict(self, out: str, expected: list[int]) -> Any:
        return compare(expected, [int(v) for v in read_committed(self.kafka, out, len(expected), timeout_s=60)])

    def _refusal(self, start: Callable[[], None], needle: str) -> str | None:
        """The line of ``start``'s error that holds ``needle``; None when it did not fail so."""
        try:
            start()
        except Exception as exc:  # noqa: BLE001 - Spark wraps the kit's ConfigError in its own
            found = next((line.strip() for line in str(exc).splitlines() if needle in line), None)
            return None if found is None else found.split(". ")[0]  # its first sentence: what and where
        return None

    # -- the cases ---------------------------------------------------------------------------

    def markers_outlive_retention(self) -> tuple[str, bool]:
        topic, out, expected = self._topics("markers")
        sink, checkpoint = self._sink(out), self.work / "markers" / "checkpoint"
        self._crashed(self._frame(topic), sink, checkpoint, partition=0)
        expired_s = self._group_offsets_expire(topic)
        self._drain(self._frame(topic), sink, checkpoint)
        verdict = self._verdict(out, expected)
        refused = self._refusal(lambda: self._drain(self._frame(topic), sink, self.work / "markers" / "second"),
                                "already written by")
        return (f"a group's offsets expired {expired_s:.0f} s after its commit; restarted then: {verdict.summary()}; "
                f"second checkpoint {'refused' if refused else 'NOT refused'}"), verdict.exactly_once and bool(refused)

    def _group_offsets_expire(self, topic: str) -> float:
        """Commit an offset for a new group now, and wait until the broker has expired it: the
        kit's state must not depend on anything that goes so."""
        group = f"oncekit-lifecycle-probe-{uuid.uuid4().hex[:8]}"
        consumer = Consumer(self.kafka.settings(group_id=group, enable_auto_commit=False))
        try:
            consumer.commit(offsets=[TopicPartition(topic, 0, 1)], asynchronous=False)
        finally:
            consumer.close()
        committed = time.monotonic()
        admin = AdminClient(self.kafka.settings())

        def expired() -> None:
            request = ConsumerGroupTopicPartitions(group, [TopicPartition(topic, 0)])
            found = admin.list_consumer_group_offsets([request])[group].result(timeout=10)
            if any(tp.offset >= 0 for tp in found.topic_partitions):
                raise VerifyError(f"group {group} still has its committed offset")

        wait_until(expired, EXPIRY_S, f"the broker's expiry of group {group}'s offsets")
        return time.monotonic() - committed

    def speculation(self) -> tuple[str, bool]:
        topic, out, _ = self._topics("speculation", count=100)
        ctx = PipelineContext(self.kafka.bootstrap_servers, topic, out, str(self.work / "speculation" / "checkpoint"),
                              kafka_client=dict(self.kafka.client))
        log = self.work / "speculation" / "driver.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        driver = start_driver("kafka-transactional", ctx, str(self.crash_dir), drain=True, log=log,
                              env={"PYSPARK_SUBMIT_ARGS": "--conf spark.speculation=true pyspark-shell"})
        code = driver.wait(timeout=300)
        line = next((x.strip() for x in log.read_text(errors="replace").splitlines()
                     if "spark.speculation=true" in x and "ConfigError:" in x), None)
        written = read_committed(self.kafka, out, 0, timeout_s=2)
        line = line.split(". ")[0] if line else None
        return (f"driver exit {code}: {line or 'no refusal in its log'}; {len(written)} records written",
                code != 0 and line is not None and not written)

    def replay_partitioning(self) -> tuple[str, bool]:
        topic, out, expected = self._topics("replay")
        sink, checkpoint = self._sink(out), self.work / "replay" / "checkpoint"
        self._crashed(self._frame(topic, 4), sink, checkpoint, partition=3)
        refused = self._refusal(lambda: self._drain(self._frame(topic, 2), sink, checkpoint), "plan changed")
        self._drain(self._frame(topic, 4), sink, checkpoint)
        expected += produce_input(self.kafka, topic, COUNT, first=COUNT)
        self._drain(self._frame(topic, 2), sink, checkpoint)
        verdict = self._verdict(out, expected)
        return (f"2 partitions for a batch half committed by 4: {refused or 'NOT refused'}; then {verdict.summary()}",
                bool(refused) and verdict.exactly_once)

    def slow_upstream(self) -> tuple[str, bool]:
        from pyspark.sql import functions as F

        topic, out, expected = self._topics("slow", count=PER_BATCH)
        sink = self._sink(out, transaction_timeout_ms=SLOW_TIMEOUT_MS)
        pause = SLOW_ROW_S

        def slow(value: str) -> str:
            time.sleep(pause)
            return value

        frame = integers(self.spark, self.kafka, topic, PER_BATCH).select(
            F.udf(slow, "string")(F.col("payload")).alias("value"))
        arrow_batch = "spark.sql.execution.arrow.maxRecordsPerBatch"
        before = self.spark.conf.get(arrow_batch)
        self.spark.conf.set(arrow_batch, "10")  # the sink sees the rows as they come, not at the end
        started = time.monotonic()
        try:
            self._drain(frame, sink, self.work / "slow" / "checkpoint")
        finally:
            self.spark.conf.set(arrow_batch, before)
        took = time.monotonic() - started
        verdict = self._verdict(out, expected)
        return (f"{len(expected)} records at {pause:g} s each over {took:.0f} s, transaction timeout "
                f"{SLOW_TIMEOUT_MS / 1000:g} s: {verdict.summary()}"), verdict.exactly_once

    def savepoint_live(self) -> tuple[str, bool]:
        topic, out, _ = self._topics("savepoint")
        root, query = self.work / "savepoint" / "checkpoints", "integers"
        ctx = PipelineContext(self.kafka.bootstrap_servers, topic, out, str(root / query),
                              kafka_client=dict(self.kafka.client))
        identity = {query: {"sink_id": "lifecycle", "fingerprint": "lifecycle"}}
        folder = str(self.work / "savepoint" / "saved")
        (self.work / "savepoint").mkdir(parents=True, exist_ok=True)
        driver = DriverProcess("kafka-transactional", ctx, str(self.crash_dir), self.work / "savepoint" / "driver.log", {})
        spark_log, lease = SparkLog(ctx.checkpoint), QueryLease(ctx.checkpoint)
        try:
            driver.ensure_running()
            wait_until(lambda: _at_least(spark_log.latest_completed(), 1), 120, "the original's first batches")
            driver.stop()
            saved = savepoints.create(str(root), folder, "stopped", identity)
            driver.ensure_running()
            wait_until(lambda: _held(lease), 120, "the restarted original's lease")
            try:
                savepoints.create(str(root), folder, "running", identity)
                create = "NOT refused"
            except SavepointError as exc:
                create = _first_line(exc).split(". ")[0]
            restored = self.work / "savepoint" / "restored"
            savepoints.restore(saved.path, str(restored), identity)
            moved = dataclasses.replace(ctx, checkpoint=str(restored / query))

            def start_restored() -> None:
                running = start_example("kafka-transactional", self.spark, moved)
                try:
                    if not running.await_termination(120):
                        raise VerifyError("the restored query ran beside its original")
                finally:
                    running.stop()

            refused = self._refusal(start_restored, "runs from")
        finally:
            driver.stop()
        return (f"create: {create}; restored start: {refused or 'NOT refused'}",
                create != "NOT refused" and "is running" in create and bool(refused))


def _at_least(batch: int | None, least: int) -> None:
    if batch is None or batch < least:
        raise VerifyError(f"batch {batch} committed, waiting for {least}")


def _held(lease: QueryLease) -> None:
    if lease.holder() is None:
        raise VerifyError("nobody holds the lease yet")


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]


def table(results: list[LifecycleResult]) -> str:
    """The campaign's table: case, expected, verdict, seen."""
    rows = [("case", "expected", "verdict", "seen")]
    rows += [(r.case, r.expected, "ok" if r.passed else "FAILED", r.seen) for r in results]
    case_w, expected_w = (max(len(row[i]) for row in rows) for i in (0, 1))
    return "\n".join(f"{case:<{case_w}}  {expected:<{expected_w}}  {verdict:<7} {seen}" for case, expected, verdict, seen in rows)


def require(results: list[LifecycleResult]) -> None:
    """Raise VerifyError naming the cases that did not end as expected."""
    failed = [r for r in results if not r.passed]
    if failed:
        raise VerifyError("lifecycle cases failed: " + "; ".join(f"{r.case}: {r.seen}" for r in failed))


"""The Kafka-to-PostgreSQL reference pipeline: payments in, balances, per-minute totals, late
events, dead letters and balance updates out, each exactly once, from ONE Spark query.

One query reads the ``payments`` topic once per batch through the kit's source, parses it, and
writes every output through one fan-out sink (:mod:`oncekit.core.fanout`) with one checkpoint
under ``<checkpoint>/pipeline``; each row carries the name of its target:

- ``dead_letters``: records that are not a payment (not JSON, a field missing or of the wrong
  type) with the reason, into PostgreSQL (idempotent, keyed by Kafka partition and offset).
- ``balances``: well-formed payments, deduplicated by event id in the JVM (Spark's
  ``dropDuplicatesWithinWatermark`` on the Kafka record time, ``dedup_ttl_s``), through
  :class:`~oncekit.reference.processor.PaymentProcessor` (applyInPandasWithState, keyed by a bucket of accounts):
  each account's running balance into PostgreSQL with two-phase commit ...
- ``balance_updates``: ... and the same balance rows into a Kafka topic, with Kafka transactions.
- ``minute_totals``: per account and event-time minute, the total of on-time payments into
  PostgreSQL (idempotent or write-ahead log, keyed by account and minute).
- ``late_events``: the side output, payments older than the account's watermark.

The stateful step and why it is one processor: :mod:`oncekit.reference.processor`. What the
outputs and checkpoints hold is read back by :mod:`oncekit.reference.outputs`. Importing this
module needs no Spark (the pipeline's configuration and restart strategy are tested without).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from psycopg import sql

from oncekit.connectors.kafka import KafkaConfig

from oncekit.connectors.kafka_admin import create_topic
from oncekit.connectors.postgres import connect
from oncekit.core import savepoint as savepoints
from oncekit.core.engine import CheckpointEngine
from oncekit.core.errors import ConfigError, PipelineError, SavepointError
from oncekit.core.restart import supervise
from oncekit.core.fanout import FanOutConfig, fan_out, sinks_of
from oncekit.core.savepoint import Savepoint
from oncekit.core.spark_log import SparkLog
from oncekit.reference import outputs
from oncekit.reference.config import PipelineConfig, RunConfig
from oncekit.reference.stages import made_up_payments, parse, process, route
from oncekit.sinks.kafka import kafka_sink
from oncekit.sinks.postgres import postgres_sink
from oncekit.sources.kafka import kafka_stream
from oncekit.sources.warm_up import WARM_UP_MODULES as SOURCE_AND_SINK_MODULES
from oncekit.sources.warm_up import analyze_for_warm_up

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

    from oncekit.core.protocol import SinkConfig
    from oncekit.core.spark.query import OncekitQuery

__all__ = ["QUERIES", "WARM_UP_MODULES", "PipelineError", "QuerySpec", "ReferencePipeline"]

logger = logging.getLogger(__name__)

QUERIES = ("pipeline",)
WARM_UP_MODULES = (*SOURCE_AND_SINK_MODULES, "oncekit.reference.processor")
"""What :meth:`ReferencePipeline.warm_up` imports in Spark's task workers: the kit's Kafka
source and sinks, and the processor (pandas, numpy)."""
TARGETS = ("dead_letters", "balances", "balance_updates", "minute_totals", "late_events")
"""A payment's JSON fields as the pipeline parses them (as text, then cast)."""


@dataclass(frozen=True)
class QuerySpec:
    """One streaming query of the pipeline: its frame, its sink and what its operators are.

    ``operators`` names the stateful operators with their versions; with the sink's identity
    and the output schema it makes the :meth:`fingerprint` that savepoints compare."""

    name: str
    frame: Any
    sink: SinkConfig
    output_mode: str
    operators: tuple[str, ...]

    def fingerprint(self) -> str:
        """A hash of what must not change between a savepoint and its restore: the query's
        name, its sinks (format, id, protocol, target, keys of each; not the addresses) and
        operators, and its output schema."""
        sinks = sinks_of(self.sink)
        identity = {
            "query": self.name,
            "sinks": [[s.format_name, s.sink_id, o.get("protocol"), o.get("table") or o.get("topic"), o.get("keycolumns", "")]
                      for s, o in ((s, s.to_options()) for s in sinks)],
            "operators": list(self.operators),
            "schema": self.frame.schema.simpleString(),
        }
        return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


class ReferencePipeline:
    """The reference pipeline over one :class:`PipelineConfig`.

    Called by the demo, ``oncekit pipeline run`` and the tests: :meth:`prepare` creates topics
    and tables, :meth:`run` runs every query once until the topic is drained (or, with a
    trigger interval, until stopped), :meth:`run_supervised` under the configured restart
    strategy. Every run resumes from the checkpoints under ``checkpoint``.
    """

    def __init__(self, config: PipelineConfig, checkpoint: str | None = None) -> None:
        self.config = config
        self.checkpoint = str(Path(checkpoint or config.pipeline.checkpoint).absolute())
        self.dsn = config.postgres_dsn()
        self.bootstrap = config.kafka_bootstrap()
        if not self.dsn or not self.bootstrap:
            raise ConfigError("pipeline: no Kafka or PostgreSQL address; set [services] kafka_bootstrap and "
                              "postgres_dsn, ONCEKIT_KAFKA_BOOTSTRAP and ONCEKIT_POSTGRES_DSN, or run 'oncekit services up'")
        self.active: list[OncekitQuery] = []

    # -- set-up --------------------------------------------------------------------------------

    def prepare(self) -> None:
        """Create the topics and tables the pipeline reads and writes (existing ones are kept),
        then preflight its sink as its query's first stream writer will
        (:meth:`~oncekit.core.engine.CheckpointEngine.preflight`: the kit's marker topics and
        tables made, the targets and the sink id checked), so that a wrong setting fails here,
        before Spark starts the query, and the query's own preflight finds all in place. Needs
        the services, not Spark: the demo runs it while Spark starts."""
        self.create_topics_and_tables()
        for name in QUERIES:
            CheckpointEngine.of(self.sink(), f"{self.checkpoint}/{name}").preflight()

    def create_topics_and_tables(self) -> None:
        """The topics and tables of :meth:`prepare` (existing ones are kept), without the kit's
        preflight: also the set-up of the benchmark's plain-PySpark peer of this pipeline."""
        kafka = KafkaConfig(self.bootstrap)
        topics = self.config.topics
        create_topic(kafka, topics.payments, partitions=topics.partitions)
        create_topic(kafka, topics.balance_updates, partitions=topics.partitions)
        tables = self.config.tables
        ddl = {
            tables.balances: "account_id bigint PRIMARY KEY, balance_cents bigint NOT NULL, events bigint NOT NULL",
            tables.minute_totals: ("account_id bigint NOT NULL, minute timestamptz NOT NULL, total_cents bigint NOT NULL, "
                                   "events bigint NOT NULL, PRIMARY KEY (account_id, minute)"),
            tables.late_events: ("event_id text PRIMARY KEY, account_id bigint NOT NULL, amount_cents bigint NOT NULL, "
                                 "event_time timestamptz NOT NULL, watermark timestamptz NOT NULL"),
            tables.dead_letters: ("kafka_partition int NOT NULL, kafka_offset bigint NOT NULL, raw text, "
                                  "reason text NOT NULL, PRIMARY KEY (kafka_partition, kafka_offset)"),
        }
        with connect(self.dsn, autocommit=True) as conn:
            for table, columns in ddl.items():
                conn.execute(sql.SQL("CREATE TABLE IF NOT EXISTS {} ({})").format(
                    sql.Identifier(*table.split(".", 1)), sql.SQL(columns)))

    # -- the queries ---------------------------------------------------------------------------

    def routed(self, spark: SparkSession) -> DataFrame:
        """The pipeline's frame: the payments topic through :func:`parse`, :func:`process` and
        :func:`route`."""
        run = self.config.pipeline
        raw = kafka_stream(spark, self.bootstrap, self.config.topics.payments,
                           max_offsets_per_trigger=run.max_offsets_per_trigger, connector=run.source)
        return route(process(parse(raw), run))

    def sink(self) -> FanOutConfig:
        """The fan-out to the five targets. Sink ids derive from the target tables and topic
        (``pg-balances``...): they name prepared transactions and markers in the database, so two
        pipelines sharing a database must write different tables."""
        tables, guarantees = self.config.tables, self.config.guarantees
        return fan_out({
            "dead_letters": postgres_sink(self.dsn, tables.dead_letters, "idempotent", columns=(
                "kafka_partition", "kafka_offset", "raw", "reason"),
                key_columns=("kafka_partition", "kafka_offset"), on_conflict="nothing"),
            "balances": postgres_sink(self.dsn, tables.balances, guarantees.balances, key_columns=("account_id",),
                                      columns=("account_id", "balance_cents", "events")),
            "balance_updates": kafka_sink(self.bootstrap, self.config.topics.balance_updates, guarantees.balance_updates,
                                          partitions=self.config.topics.partitions, columns=("key", "value")),
            "minute_totals": postgres_sink(self.dsn, tables.minute_totals, guarantees.minute_totals,
                                           key_columns=("account_id", "minute"),
                                           columns=("account_id", "minute", "total_cents", "events")),
            "late_events": postgres_sink(self.dsn, tables.late_events, "idempotent", key_columns=("event_id",),
                                         on_conflict="nothing",
                                         columns=("event_id", "account_id", "amount_cents", "event_time", "watermark")),
        })

    def queries(self, spark: SparkSession) -> list[QuerySpec]:
        """The pipeline's one query (a list, so that savepoints and fingerprints stay general)."""
        from oncekit.reference.processor import PROCESSOR_VERSION

        run = self.config.pipeline
        operators = (f"kafka:{run.source}", "parse", f"dropDuplicatesWithinWatermark:event_id:kafka_ts:ttl={run.dedup_ttl_s}",
                     f"applyInPandasWithState:PaymentProcessor:v{PROCESSOR_VERSION}:lateness={run.allowed_lateness_s}"
                     f":buckets={run.buckets}")
        return [QuerySpec("pipeline", self.routed(spark), self.sink(), "append", operators)]

    def fingerprints(self, spark: SparkSession) -> dict[str, dict[str, str]]:
        """Per query: its sink id and fingerprint (what a savepoint records and a restore checks)."""
        return {q.name: {"sink_id": q.sink.sink_id, "fingerprint": q.fingerprint()} for q in self.queries(spark)}

    # -- running -------------------------------------------------------------------------------

    @staticmethod
    def warm_up(spark: SparkSession, run: RunConfig | None = None) -> float:
        """Start the Spark processes the pipeline's first batch needs and run its plan once,
        before it runs: Spark's Python planner processes, task workers that have imported
        :data:`WARM_UP_MODULES` (Spark reuses its task workers), and one micro-batch of two
        made-up payments through the pipeline's own :func:`parse`, :func:`process` (with
        ``run``'s settings) and :func:`route` into a sink that keeps nothing, so that the JVM
        has planned and compiled its operators, loaded RocksDB and run the processor
        (:func:`oncekit.core.spark.standby.warm_up`). Touches no service and no checkpoint, so it
        can run while the services start: the demo does so, and a standby does it while it
        waits. Returns the seconds it took. Without it, a fresh session's first batch starts
        each of those processes and imports in each of them, one stage after the other
        (docs/reference-pipeline.md, "Where the time goes")."""
        from oncekit.core.spark.standby import warm_up

        return warm_up(spark, WARM_UP_MODULES, analyze_for_warm_up, ReferencePipeline.warm_up_plan(run))

    @staticmethod
    def warm_up_plan(run: RunConfig | None = None) -> Callable[[DataFrame], DataFrame]:
        """The pipeline's plan over the warm-up source (:func:`made_up_payments`), with ``run``'s
        settings (the defaults if None): the ``plan`` of :func:`oncekit.core.spark.standby.warm_up`
        and of the pipeline's standby."""
        settings = run or RunConfig()
        return lambda frame: route(process(parse(made_up_payments(frame)), settings))

    def start(self, spark: SparkSession) -> list[OncekitQuery]:
        """Start every query from its checkpoint under :attr:`checkpoint`."""
        from oncekit.core.spark.query import Trigger, start_query

        run = self.config.pipeline
        # A batch without data only moves the dedup watermark (state eviction); the next batch
        # with data does that as well, and each saved batch is one fewer commit in every target.
        # Each query copies the session's settings when it starts, so the session is left as it was.
        no_data = "spark.sql.streaming.noDataMicroBatches.enabled"
        previous = spark.conf.get(no_data)
        spark.conf.set(no_data, "false")
        trigger = Trigger(processing_time=f"{run.trigger_s} seconds") if run.trigger_s > 0 else Trigger(available_now=True)
        self.active = []
        try:
            for spec in self.queries(spark):
                self.active.append(start_query(spec.frame, spec.sink, f"{self.checkpoint}/{spec.name}", trigger=trigger,
                                               query_name=spec.name, output_mode=spec.output_mode))
        except BaseException:
            self.stop()
            raise
        finally:
            spark.conf.set(no_data, previous or "true")
        return self.active

    def stop(self) -> None:
        """Stop every running query; each stop commits what completed checkpoints hold, and a
        query that did not fail gives up its lease (a failed one keeps it for its restart)."""
        for query in self.active:
            try:
                if query.isActive or query.exception() is None:
                    query.stop()
                else:
                    query.complete()
            except Exception as exc:  # stopping the rest matters more; the next start recovers
                logger.warning("query %s: stop failed: %s", query.name, exc)

    def run(self, spark: SparkSession, tick: Callable[[list[OncekitQuery]], None] | None = None,
            should_stop: Callable[[], bool] | None = None, poll_s: float = 0.5) -> None:
        """One attempt: start every query and wait until all have finished (drained the topic) or
        ``should_stop`` says so (then they stop at a batch boundary); ``tick`` is called every
        ``poll_s``, and the end of a query is seen as it ends. If a query fails, the others are
        stopped and :class:`PipelineError` is raised (a restart resumes from the checkpoints)."""
        queries = self.start(spark)
        try:
            while True:
                failed = [q for q in queries if q.exception() is not None]
                if failed:
                    raise PipelineError(f"query {failed[0].name} failed: {failed[0].exception()}")
                if tick is not None:
                    tick(queries)
                if should_stop is not None and should_stop():
                    self.stop_at_batch_boundary(stopped_with="a savepoint")
                    break
                active = [q for q in queries if q.isActive]
                if not active:
                    break
                with contextlib.suppress(Exception):  # a failure is raised as PipelineError on the next round
                    active[0].query.awaitTermination(poll_s)  # type: ignore[arg-type]  # returns as soon as it ends
        finally:
            self.stop()
        failed = [q for q in queries if q.exception() is not None]
        if failed:
            raise PipelineError(f"query {failed[0].name} failed: {failed[0].exception()}")

    def run_supervised(self, session: Callable[[], SparkSession],
                       tick: Callable[[list[OncekitQuery]], None] | None = None,
                       on_restart: Callable[[int, BaseException], None] | None = None,
                       should_stop: Callable[[], bool] | None = None) -> int:
        """:meth:`run` under the configured restart strategy, each attempt on ``session()``
        (:func:`~oncekit.core.spark.session.spark_session`: the same session in classic Spark, a
        new one after a Spark Connect server went away); returns the number of restarts or
        raises RestartsExhaustedError when the strategy gives up."""
        return supervise(lambda: self.run(session(), tick, should_stop), self.config.restart_strategy(), on_restart)

    # -- savepoints ----------------------------------------------------------------------------

    def stop_at_batch_boundary(self, timeout_s: float = 120.0, stopped_with: str = "") -> None:
        """Stop every running query between two batches: wait (up to ``timeout_s``) until no
        trigger is running, then stop (for a savepoint: ``stopped_with``, which keeps standbys
        waiting). A batch that starts in between is re-run on restore."""
        deadline = time.monotonic() + timeout_s
        for query in self.active:
            query.stop_at_batch_boundary(max(0.0, deadline - time.monotonic()), stopped_with=stopped_with)

    def savepoint(self, spark: SparkSession, into: str, name: str) -> Savepoint:
        """Stop-with-savepoint: stop the running queries at a batch boundary (if any run) and
        copy their checkpoints to ``<into>/<name>``. Called by the pipeline runner when
        ``oncekit savepoint create`` asks, and by tests."""
        self.stop_at_batch_boundary(stopped_with=f"savepoint {name}")
        return savepoints.create(self.checkpoint, into, name, self.fingerprints(spark))

    def restore(self, spark: SparkSession, savepoint_path: str, state_partitions: int | None = None) -> Savepoint:
        """Copy the savepoint into this pipeline's (new, empty) checkpoint location after
        checking that its queries, sink ids and fingerprints are this pipeline's. The state
        keeps the savepoint's partitions, or with ``state_partitions`` is rescaled to that many
        by Spark's offline repartitioning (:func:`oncekit.core.spark.state.repartition_state`;
        StateRescaleError names an operator Spark cannot rescale). Called by ``oncekit savepoint
        restore``, ``oncekit pipeline run --from-savepoint`` and tests."""
        from oncekit.core.spark.state import repartition_state

        saved = savepoints.restore(savepoint_path, self.checkpoint, self.fingerprints(spark))
        if state_partitions is None or all(q.state_partitions == state_partitions for q in saved.queries):
            return saved
        self.finish_planned_batches(spark)
        for query in saved.queries:
            repartition_state(spark, f"{self.checkpoint}/{query.name}", state_partitions, query.name)
        return saved

    def finish_planned_batches(self, spark: SparkSession, attempts: int = 3) -> None:
        """Run the queries until every batch in their offset logs has committed (Spark
        repartitions state only after a committed batch; a savepoint keeps a batch that was
        planned when its queries stopped). The run is this pipeline's own, exactly once like any
        other; it may go on to a few more batches before it stops at a batch boundary."""
        def pending() -> list[str]:
            logs = {name: SparkLog(f"{self.checkpoint}/{name}") for name in QUERIES}
            return [name for name, log in logs.items() if log.latest_planned() != log.latest_completed()]

        for _ in range(attempts):
            waiting = pending()
            if not waiting:
                return
            logger.info("queries %s: running the batch planned before the savepoint before rescaling", waiting)
            wanted = {name: SparkLog(f"{self.checkpoint}/{name}").latest_planned() for name in waiting}
            self.run(spark, should_stop=lambda: all(
                wanted[name] in SparkLog(f"{self.checkpoint}/{name}").completed() for name in waiting))
        if pending():
            raise SavepointError(f"queries {', '.join(pending())} at {self.checkpoint}: a planned batch did not commit "
                                 f"in {attempts} runs; run the pipeline from there, stop it, then rescale a new savepoint")

    # -- progress ------------------------------------------------------------------------------

    def progress(self) -> dict[str, int]:
        """What the checkpoints and the server say right now (:func:`oncekit.reference.outputs.progress`):
        committed batches, payments records consumed by committed batches, and prepared
        transactions waiting in PostgreSQL."""
        return outputs.progress(self.checkpoint, QUERIES, "pipeline", self.dsn)

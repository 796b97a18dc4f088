"""The Kafka-to-PostgreSQL reference pipeline: payments in, balances, per-minute totals, late
events, dead letters and balance updates out, each exactly once.

The data flow, with one Spark query per sink (Spark writes each query to one sink), all reading
the ``payments`` topic through the kit's source, each with its own checkpoint under
``<checkpoint>/<query>``:

- ``dead_letters``: records that are not a payment (not JSON, a field missing or of the wrong
  type) with the reason, into PostgreSQL (idempotent, keyed by Kafka partition and offset).
- ``balances``: well-formed payments through :class:`PaymentProcessor` (transformWithState,
  keyed by account), each account's running balance into PostgreSQL with two-phase commit.
- ``balance_updates``: the same balance rows into a Kafka topic, with Kafka transactions.
- ``minute_totals``: per account and event-time minute, the total of on-time payments into
  PostgreSQL (idempotent or write-ahead log, keyed by account and minute).
- ``late_events``: the side output, payments older than the account's watermark.

Why one processor keyed by account does dedup, balance and event time, rather than Spark's
``dropDuplicates`` plus a windowed aggregation: the producer keys payments by account, so an
account's events sit in one Kafka partition in a fixed order. The processor takes each batch's
rows of an account in offset order, so which events are duplicates and which are late is a
pure function of the log, the same whatever the batch boundaries and however often a batch is
replayed. Spark's global watermark moves per batch, and its windowed aggregation drops late
rows without a side output. Here the watermark is per account (newest event time seen minus
``allowed_lateness_s``), like Flink's per-partition watermarks; a minute whose end is behind it
is final and leaves the state. Seen event ids live in a MapState with a processing-time TTL
(``dedup_ttl_s``); the balance and the account's clock in ValueStates.

Balances count every unique well-formed payment, late ones included (money is money); only
the per-minute totals leave late payments out, and the side output lists them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from oncekit.config import PipelineConfig
from oncekit.core.errors import ConfigError, OncekitError

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

    from oncekit.core.query import OncekitQuery
    from oncekit.core.savepoint import Savepoint
    from oncekit.sinks.base import SinkConfig

logger = logging.getLogger(__name__)

PROCESSOR_VERSION = 1
"""Part of every query's fingerprint: bump it when the processor's state layout changes, so
that restoring an old savepoint is refused instead of misreading state."""

QUERIES = ("dead_letters", "balances", "balance_updates", "minute_totals", "late_events")

PROCESSED_SCHEMA = (
    "kind string, account_id bigint, balance_cents bigint, events bigint, minute_ms bigint, total_cents bigint, "
    "event_id string, amount_cents bigint, event_ms bigint, watermark_ms bigint"
)


class PipelineError(OncekitError):
    """A query of the pipeline failed; ``__cause__`` is Spark's error."""


def _processor_type() -> type[Any]:
    """The processor class, built on first use so that importing this module needs no Spark."""
    from pyspark.sql import Row
    from pyspark.sql.streaming.stateful_processor import StatefulProcessor, StatefulProcessorHandle, TimerValues

    class PaymentProcessor(StatefulProcessor):
        """Keyed by account. Per batch, in Kafka offset order: drop event ids seen before
        (MapState with TTL), add the rest to the balance (ValueState), and split them into
        on-time (added to their minute's total, MapState) and late (older than the account's
        watermark, emitted as ``late``). Emits one ``balance`` row per account and one ``total``
        row per minute touched in the batch; minutes the watermark has passed are final and
        evicted. Runs in Spark's Python workers; every decision depends only on the log order."""

        def __init__(self, dedup_ttl_ms: int, allowed_lateness_ms: int) -> None:
            self.dedup_ttl_ms, self.allowed_lateness_ms = dedup_ttl_ms, allowed_lateness_ms

        def init(self, handle: StatefulProcessorHandle) -> None:
            self.seen = handle.getMapState("seen", "event_id string", "seen boolean", self.dedup_ttl_ms)
            self.balance = handle.getValueState("balance", "balance_cents bigint, events bigint")
            self.clock = handle.getValueState("clock", "max_event_ms bigint")
            self.minutes = handle.getMapState("minutes", "minute_ms bigint", "total_cents bigint, events bigint")

        def handleInputRows(self, key: Any, rows: Iterator[Any], timerValues: TimerValues) -> Iterator[Any]:
            account = key[0]
            stored_balance, stored_clock = self.balance.get(), self.clock.get()
            balance, events = (stored_balance[0], stored_balance[1]) if stored_balance else (0, 0)
            clock = stored_clock[0] if stored_clock else None
            touched: dict[int, tuple[int, int]] = {}
            empty = dict.fromkeys(("balance_cents", "events", "minute_ms", "total_cents", "event_id", "amount_cents",
                                   "event_ms", "watermark_ms"))
            for row in sorted(rows, key=lambda r: (r.kafka_partition, r.kafka_offset)):
                if self.seen.containsKey((row.event_id,)):
                    continue
                self.seen.updateValue((row.event_id,), (True,))
                balance, events = balance + row.amount_cents, events + 1
                watermark = None if clock is None else clock - self.allowed_lateness_ms
                if watermark is not None and row.event_ms < watermark:
                    yield Row(**{**empty, "kind": "late", "account_id": account, "event_id": row.event_id,
                                 "amount_cents": row.amount_cents, "event_ms": row.event_ms, "watermark_ms": watermark})
                else:
                    minute = row.event_ms // 60_000 * 60_000
                    if minute not in touched:
                        stored = self.minutes.getValue((minute,))
                        touched[minute] = (stored[0], stored[1]) if stored else (0, 0)
                    total, count = touched[minute]
                    touched[minute] = (total + row.amount_cents, count + 1)
                clock = row.event_ms if clock is None else max(clock, row.event_ms)
            if clock is None:
                return
            self.balance.update((balance, events))
            self.clock.update((clock,))
            yield Row(**{**empty, "kind": "balance", "account_id": account, "balance_cents": balance, "events": events})
            for minute, (total, count) in sorted(touched.items()):
                self.minutes.updateValue((minute,), (total, count))
                yield Row(**{**empty, "kind": "total", "account_id": account, "minute_ms": minute,
                             "total_cents": total, "events": count})
            watermark = clock - self.allowed_lateness_ms
            for (minute,) in list(self.minutes.keys()):
                if minute + 60_000 <= watermark:
                    self.minutes.removeKey((minute,))

        def close(self) -> None:
            pass

    return PaymentProcessor


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
        name, its sink (format, id, protocol, target, keys; not the addresses) and operators,
        and its output schema."""
        options = self.sink.to_options()
        identity = {
            "query": self.name,
            "sink": [self.sink.format_name, self.sink.sink_id, options.get("protocol"), options.get("table") or
                     options.get("topic"), options.get("keycolumns", "")],
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
        """Create the topics and tables the pipeline reads and writes (existing ones are kept)."""
        from psycopg import sql

        from oncekit.connectors import KafkaConfig
        from oncekit.connectors.kafka import create_topic
        from oncekit.connectors.postgres import connect

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

    def parsed(self, spark: SparkSession) -> DataFrame:
        """Every payments record with its parsed fields and, for records that are not a
        payment, the reason (NULL for good ones)."""
        from pyspark.sql import functions as F

        from oncekit.sources.kafka import kafka_stream

        raw = kafka_stream(spark, self.bootstrap, self.config.topics.payments,
                           max_offsets_per_trigger=self.config.pipeline.max_offsets_per_trigger)
        text = F.col("value").cast("string")
        fields = F.from_json(text, "map<string,string>")
        event_time = F.expr("try_cast(fields['event_time'] AS timestamp)")
        checks = [
            (F.col("fields")["event_id"].isNull(), "event_id missing"),
            (F.expr("try_cast(fields['account_id'] AS bigint)").isNull(), "account_id missing or not an integer"),
            (F.expr("try_cast(fields['amount_cents'] AS bigint)").isNull(), "amount_cents missing or not an integer"),
            (event_time.isNull(), "event_time missing or not a timestamp"),
        ]
        problems = F.concat_ws("; ", *[F.when(bad, F.lit(reason)) for bad, reason in checks])
        return (raw.select(F.col("partition").alias("kafka_partition"), F.col("offset").alias("kafka_offset"),
                           text.alias("raw"), fields.alias("fields"))
                .select("kafka_partition", "kafka_offset", "raw", "fields",
                        F.when(F.col("fields").isNull(), F.lit("not a JSON object"))
                         .when(problems != "", problems).alias("reason"))
                .select("kafka_partition", "kafka_offset", "raw", "reason",
                        F.col("fields")["event_id"].alias("event_id"),
                        F.expr("try_cast(fields['account_id'] AS bigint)").alias("account_id"),
                        F.expr("try_cast(fields['amount_cents'] AS bigint)").alias("amount_cents"),
                        F.expr("unix_millis(try_cast(fields['event_time'] AS timestamp))").alias("event_ms")))

    def processed(self, spark: SparkSession) -> DataFrame:
        """Well-formed payments through :class:`PaymentProcessor`: rows of kind ``balance``,
        ``total`` and ``late`` (schema :data:`PROCESSED_SCHEMA`).

        The processor runs in Append mode (the kit's sinks take appends): each row it emits is a
        fact of its batch, and the sinks turn balance and total rows into upserts by key."""
        run = self.config.pipeline
        processor = _processor_type()(run.dedup_ttl_s * 1000, run.allowed_lateness_s * 1000)
        payments = (self.parsed(spark).where("reason IS NULL")
                    .select("account_id", "event_id", "amount_cents", "event_ms", "kafka_partition", "kafka_offset"))
        return payments.groupBy("account_id").transformWithState(
            statefulProcessor=processor, outputStructType=PROCESSED_SCHEMA, outputMode="Append",
            timeMode="ProcessingTime")  # processing time: the dedup state's TTL

    def queries(self, spark: SparkSession) -> list[QuerySpec]:
        """The five queries, in the order they start. Sink ids derive from the target tables and
        topic (``pg-balances``...): they name prepared transactions and markers in the database,
        so two pipelines sharing a database must write different tables."""
        from pyspark.sql import functions as F

        from oncekit.sinks.kafka import kafka_sink
        from oncekit.sinks.postgres import postgres_sink

        tables, guarantees = self.config.tables, self.config.guarantees
        processor = (f"transformWithState:PaymentProcessor:v{PROCESSOR_VERSION}:"
                     f"lateness={self.config.pipeline.allowed_lateness_s}")
        balances = self.processed(spark).where("kind = 'balance'").select("account_id", "balance_cents", "events")
        return [
            QuerySpec("dead_letters",
                      self.parsed(spark).where("reason IS NOT NULL").select("kafka_partition", "kafka_offset", "raw", "reason"),
                      postgres_sink(self.dsn, tables.dead_letters, "idempotent", key_columns=("kafka_partition", "kafka_offset"), on_conflict="nothing"),
                      "append", ("parse",)),
            QuerySpec("balances", balances,
                      postgres_sink(self.dsn, tables.balances, guarantees.balances, key_columns=("account_id",)),
                      "append", ("parse", processor)),
            QuerySpec("balance_updates",
                      self.processed(spark).where("kind = 'balance'").select(
                          F.col("account_id").cast("string").alias("key"),
                          F.to_json(F.struct("account_id", "balance_cents", "events")).alias("value")),
                      kafka_sink(self.bootstrap, self.config.topics.balance_updates, guarantees.balance_updates,
                                 partitions=self.config.topics.partitions),
                      "append", ("parse", processor)),
            QuerySpec("minute_totals",
                      self.processed(spark).where("kind = 'total'").select(
                          "account_id", F.timestamp_millis("minute_ms").alias("minute"), "total_cents", "events"),
                      postgres_sink(self.dsn, tables.minute_totals, guarantees.minute_totals, key_columns=("account_id", "minute")),
                      "append", ("parse", processor)),
            QuerySpec("late_events",
                      self.processed(spark).where("kind = 'late'").select(
                          "event_id", "account_id", "amount_cents", F.timestamp_millis("event_ms").alias("event_time"),
                          F.timestamp_millis("watermark_ms").alias("watermark")),
                      postgres_sink(self.dsn, tables.late_events, "idempotent", key_columns=("event_id",), on_conflict="nothing"),
                      "append", ("parse", processor)),
        ]

    def fingerprints(self, spark: SparkSession) -> dict[str, dict[str, str]]:
        """Per query: its sink id and fingerprint (what a savepoint records and a restore checks)."""
        return {q.name: {"sink_id": q.sink.sink_id, "fingerprint": q.fingerprint()} for q in self.queries(spark)}

    # -- running -------------------------------------------------------------------------------

    def start(self, spark: SparkSession) -> list[OncekitQuery]:
        """Start every query from its checkpoint under :attr:`checkpoint`."""
        from oncekit.core.query import start_query

        run = self.config.pipeline
        # The processor's processing-time mode (for the TTL) makes Spark run a batch without data
        # after every batch, forever, and an availableNow query would never finish; expired ids
        # are dropped in the next batch with data instead.
        # Each query copies the session's settings when it starts, so the session is left as it was.
        no_data = "spark.sql.streaming.noDataMicroBatches.enabled"
        previous = spark.conf.get(no_data)
        spark.conf.set(no_data, "false")
        trigger = {"processingTime": f"{run.trigger_s} seconds"} if run.trigger_s > 0 else {"availableNow": True}
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
        """Stop every running query; each stop commits what completed checkpoints hold."""
        for query in self.active:
            try:
                if query.isActive:
                    query.stop()
                else:
                    query.complete()
            except Exception as exc:  # stopping the rest matters more; the next start recovers
                logger.warning("query %s: stop failed: %s", query.name, exc)

    def run(self, spark: SparkSession, tick: Callable[[list[OncekitQuery]], None] | None = None,
            should_stop: Callable[[], bool] | None = None, poll_s: float = 0.5) -> None:
        """One attempt: start every query and wait until all have finished (drained the topic) or
        ``should_stop`` says so (then they stop at a batch boundary); ``tick`` is called every ``poll_s``. If a query fails, the others
        are stopped and :class:`PipelineError` is raised (a restart resumes from the checkpoints)."""
        queries = self.start(spark)
        try:
            while True:
                failed = [q for q in queries if q.exception() is not None]
                if failed:
                    raise PipelineError(f"query {failed[0].name} failed: {failed[0].exception()}")
                if tick is not None:
                    tick(queries)
                if should_stop is not None and should_stop():
                    self.stop_at_batch_boundary()
                    break
                if not any(q.isActive for q in queries):
                    break
                time.sleep(poll_s)
        finally:
            self.stop()
        failed = [q for q in queries if q.exception() is not None]
        if failed:
            raise PipelineError(f"query {failed[0].name} failed: {failed[0].exception()}")

    def run_supervised(self, spark: SparkSession, tick: Callable[[list[OncekitQuery]], None] | None = None,
                       on_restart: Callable[[int, BaseException], None] | None = None,
                       should_stop: Callable[[], bool] | None = None) -> int:
        """:meth:`run` under the configured restart strategy; returns the number of restarts or
        raises RestartsExhaustedError when the strategy gives up."""
        from oncekit.core.restart import supervise

        return supervise(lambda: self.run(spark, tick, should_stop), self.config.restart_strategy(), on_restart)

    # -- savepoints ----------------------------------------------------------------------------

    def stop_at_batch_boundary(self, timeout_s: float = 120.0) -> None:
        """Stop every running query between two batches: wait (up to ``timeout_s``) until no
        trigger is running, then stop. A batch that starts in between is re-run on restore."""
        deadline = time.monotonic() + timeout_s
        for query in self.active:
            while query.isActive and query.status.get("isTriggerActive") and time.monotonic() < deadline:
                time.sleep(0.1)
            if query.isActive:
                query.stop()
            else:
                query.complete()

    def savepoint(self, spark: SparkSession, into: str, name: str) -> Savepoint:
        """Stop-with-savepoint: stop the running queries at a batch boundary (if any run) and
        copy their checkpoints to ``<into>/<name>``. Called by the pipeline runner when
        ``oncekit savepoint create`` asks, and by tests."""
        from oncekit.core import savepoint

        self.stop_at_batch_boundary()
        return savepoint.create(self.checkpoint, into, name, self.fingerprints(spark))

    def restore(self, spark: SparkSession, savepoint_path: str) -> Savepoint:
        """Copy the savepoint into this pipeline's (new, empty) checkpoint location after
        checking that its queries, sink ids and fingerprints are this pipeline's."""
        from oncekit.core import savepoint

        return savepoint.restore(savepoint_path, self.checkpoint, self.fingerprints(spark))

    # -- progress ------------------------------------------------------------------------------

    def progress(self) -> dict[str, int]:
        """What the checkpoints and the server say right now: committed batches over all
        queries, payments records consumed by committed batches of the balances query, and
        prepared transactions waiting in PostgreSQL."""
        from oncekit.connectors.postgres import connect

        committed = 0
        for name in QUERIES:
            commits = Path(self.checkpoint, name, "commits")
            if commits.is_dir():
                committed += sum(1 for p in commits.iterdir() if p.name.isdigit())
        with connect(self.dsn, autocommit=True, connect_timeout=5) as conn:
            row = conn.execute("SELECT count(*) FROM pg_prepared_xacts WHERE starts_with(gid, 'oncekit:')").fetchone()
        return {"checkpoints": committed, "records": consumed(f"{self.checkpoint}/balances"),
                "prepared": int(row[0]) if row else 0}


def last_committed_batch(checkpoint: str) -> int | None:
    """The newest batch in ``<checkpoint>/commits`` (None before the first)."""
    commits = Path(checkpoint, "commits")
    batches = [int(p.name) for p in commits.iterdir() if p.name.isdigit()] if commits.is_dir() else []
    return max(batches) if batches else None


def consumed(checkpoint: str) -> int:
    """Records (offsets) the query's committed batches have read, from its offset log."""
    batch = last_committed_batch(checkpoint)
    if batch is None:
        return 0
    lines = Path(checkpoint, "offsets", str(batch)).read_text().splitlines()
    total = 0
    for line in lines[2:]:  # version, batch metadata, then one offset JSON per source
        try:
            offsets = json.loads(line)
        except ValueError:
            continue
        if isinstance(offsets, dict):
            total += sum(int(o) for parts in offsets.values() if isinstance(parts, dict) for o in parts.values())
    return total

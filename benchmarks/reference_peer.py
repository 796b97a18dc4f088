"""The reference pipeline as a PySpark user writes it today: the peer of the reference group.

Same input, same stages, same outputs, at-least-once. Spark's own Kafka source reads the payments
topic; the pipeline's own :func:`~oncekit.reference.stages.parse`, :func:`~oncekit.reference.stages.process`
(``dropDuplicatesWithinWatermark``, ``applyInPandasWithState``) and :func:`~oncekit.reference.stages.route`
make the rows; ``foreachBatch`` writes them, the batch persisted once:

- the balance updates with Spark's Kafka sink (``write.format("kafka")``);
- the four tables from the tasks with psycopg, one connection and one transaction per partition:
  each table's rows COPYed into a temporary table, then one ``INSERT ... SELECT DISTINCT ON
  ... ON CONFLICT`` into the table (the last row of a key wins for an update, the first for
  ``nothing``, as the kit's sinks do; the tables, columns and keys are the kit pipeline's).

A batch replayed after a crash writes again (its Kafka records repeat); the bench crashes
nothing, so the peer's outputs are checked as the kit's are.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import partial
from typing import TYPE_CHECKING, Any

from psycopg import sql

from oncekit.reference.pipeline import ReferencePipeline
from oncekit.reference.stages import parse, process, route
from oncekit.sinks.postgres.config import PostgresSinkConfig

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

    from oncekit.reference.config import PipelineConfig

UPDATES = "balance_updates"
"""The route value of the rows that go to Kafka; every other route value is a table."""


@dataclass(frozen=True)
class TableSpec:
    """Where one route value's rows go, from the kit pipeline's sink configuration."""

    table: str
    columns: tuple[str, ...]
    keys: tuple[str, ...]
    update: bool

    def merge(self, staging: sql.Composable) -> sql.Composed:
        """``staging``'s rows (with their ``ordinal``) into the table, one row per key."""
        columns = sql.SQL(", ").join(map(sql.Identifier, self.columns))
        keys = sql.SQL(", ").join(map(sql.Identifier, self.keys))
        rest = [c for c in self.columns if c not in self.keys]
        action = sql.SQL("DO UPDATE SET {}").format(sql.SQL(", ").join(
            sql.SQL("{0} = EXCLUDED.{0}").format(sql.Identifier(c)) for c in rest)) if self.update else sql.SQL("DO NOTHING")
        return sql.SQL("INSERT INTO {table} ({columns}) SELECT DISTINCT ON ({keys}) {columns} FROM {staging} "
                       "ORDER BY {keys}, ordinal {order} ON CONFLICT ({keys}) {action}").format(
            table=sql.Identifier(*self.table.split(".", 1)), columns=columns, keys=keys, staging=staging,
            order=sql.SQL("DESC" if self.update else "ASC"), action=action)


def write_tables(dsn: str, specs: dict[str, TableSpec], rows: Iterable[Any]) -> None:
    """One task's rows into their tables, in one transaction (``foreachPartition``)."""
    import psycopg

    by_target: dict[str, list[tuple[Any, ...]]] = {}
    for row in rows:
        spec = specs[row["target"]]
        by_target.setdefault(row["target"], []).append(tuple(_utc(row[c]) for c in spec.columns))
    if not by_target:
        return
    with psycopg.connect(dsn) as conn:
        for target, values in by_target.items():
            spec = specs[target]
            staging = sql.Identifier(f"peer_{target}")
            conn.execute(sql.SQL("CREATE TEMP TABLE {} ON COMMIT DROP AS SELECT {}, 0::bigint AS ordinal FROM {} WITH NO DATA")
                         .format(staging, sql.SQL(", ").join(map(sql.Identifier, spec.columns)),
                                 sql.Identifier(*spec.table.split(".", 1))))
            names = sql.SQL(", ").join(map(sql.Identifier, (*spec.columns, "ordinal")))
            with conn.cursor().copy(sql.SQL("COPY {} ({}) FROM STDIN").format(staging, names)) as copy:
                for ordinal, value in enumerate(values):
                    copy.write_row((*value, ordinal))
            conn.execute(spec.merge(staging))


def _utc(value: Any) -> Any:
    """PySpark's timestamps are naive local times; PostgreSQL's columns are timestamptz."""
    return value.astimezone(timezone.utc) if isinstance(value, datetime) and value.tzinfo is None else value


class PeerPipeline:
    """The plain-PySpark pipeline over the kit pipeline's :class:`PipelineConfig` (its topics,
    tables, batch size and stage settings), with the small surface the reference group drives:
    :meth:`prepare`, :meth:`start`, :meth:`run`, :attr:`active`, :meth:`stop`."""

    def __init__(self, config: PipelineConfig, checkpoint: str | None = None) -> None:
        self.config = config
        self.kit = ReferencePipeline(config, checkpoint or tempfile.mkdtemp(prefix="oncekit-peer-"))
        self.checkpoint = self.kit.checkpoint
        self.specs = {
            target: TableSpec(sink.table, sink.columns, sink.key_columns, sink.on_conflict == "update")
            for target, sink in self.kit.sink().targets.items() if isinstance(sink, PostgresSinkConfig)}
        self.active: list[Any] = []

    def prepare(self) -> None:
        self.kit.create_topics_and_tables()

    def frame(self, spark: SparkSession) -> DataFrame:
        run = self.config.pipeline
        raw = (spark.readStream.format("kafka").option("kafka.bootstrap.servers", self.kit.bootstrap)
               .option("subscribe", self.config.topics.payments).option("startingOffsets", "earliest")
               .option("maxOffsetsPerTrigger", run.max_offsets_per_trigger).load())
        return route(process(parse(raw), run))

    def write_batch(self, frame: DataFrame, batch_id: int) -> None:
        from pyspark.sql import functions as F

        frame.persist()
        try:
            (frame.filter(F.col("target") == UPDATES).select("key", "value").write.format("kafka")
             .option("kafka.bootstrap.servers", self.kit.bootstrap).option("topic", self.config.topics.balance_updates)
             .save())
            frame.filter(F.col("target") != UPDATES).foreachPartition(partial(write_tables, self.kit.dsn, self.specs))
        finally:
            frame.unpersist()

    def start(self, spark: SparkSession) -> list[Any]:
        run = self.config.pipeline
        no_data = "spark.sql.streaming.noDataMicroBatches.enabled"  # as the kit pipeline runs
        previous = spark.conf.get(no_data)
        spark.conf.set(no_data, "false")
        try:
            writer = self.frame(spark).writeStream.foreachBatch(self.write_batch).queryName("peer") \
                .option("checkpointLocation", f"{self.checkpoint}/peer")
            writer = writer.trigger(processingTime=f"{run.trigger_s} seconds") if run.trigger_s > 0 \
                else writer.trigger(availableNow=True)
            self.active = [writer.start()]
        finally:
            spark.conf.set(no_data, previous or "true")
        return self.active

    def run(self, spark: SparkSession, poll_s: float = 0.5) -> None:
        """Start, and wait until the topic is drained (availableNow); a failure is raised."""
        (query,) = self.start(spark)
        query.awaitTermination()
        if query.exception() is not None:
            raise RuntimeError(f"the peer query failed: {query.exception()}")

    def stop_at_batch_boundary(self, timeout_s: float = 120.0) -> None:
        """Stop once no trigger runs (up to ``timeout_s``): a stop inside ``foreachBatch``
        interrupts its writes."""
        deadline = time.monotonic() + timeout_s
        for query in self.active:
            while query.isActive and query.status["isTriggerActive"] and time.monotonic() < deadline:
                time.sleep(0.05)
        self.stop()

    def stop(self) -> None:
        for query in self.active:
            query.stop()

"""The reference pipeline's stages as Spark frames, one function each: :func:`parse` the payments
records, :func:`process` them through the stateful processor, :func:`route` its packed output to
the targets; and :func:`made_up_payments` for the warm-up. :class:`~oncekit.reference.pipeline.ReferencePipeline`
builds its query from them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from oncekit.reference.config import RunConfig

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

FIELDS = "event_id string, account_id string, amount_cents string, event_time string"
"""The payment fields a record's JSON value holds (all as text: :func:`parse` checks them)."""


def made_up_payments(frame: DataFrame) -> DataFrame:
    """For :meth:`ReferencePipeline.warm_up`: a payment record in Kafka's columns for each row
    of ``frame`` (the warm-up source's, an int ``value`` per row), on the row's value as
    partition."""
    from pyspark.sql import functions as F

    payment = F.format_string('{"event_id": "warm-up-%d", "account_id": %d, "amount_cents": 100, '
                              '"event_time": "2026-01-01T00:00:00+00:00"}', "value", "value")
    return frame.select(F.col("value").alias("partition"), F.col("value").cast("long").alias("offset"),
                        F.current_timestamp().alias("timestamp"), payment.cast("binary").alias("value"))


def parse(raw: DataFrame) -> DataFrame:
    """Every payments record of ``raw`` (Kafka's columns ``partition``, ``offset``, ``timestamp``
    and ``value``) with its parsed fields and, for records that are not a payment, the reason
    and the value as text (``raw``, the dead letters'); both NULL for good ones, whose text would
    only weigh on the shuffles and the processor's input."""
    from pyspark.sql import functions as F

    text = F.col("value").cast("string")
    # The four fields as text (a JSON number as its digits), and text that is not a JSON
    # object in the corrupt-record column (or the whole struct NULL): a struct is parsed
    # without building a map per record, with the same field values a map<string,string> gives.
    fields = F.from_json(text, f"{FIELDS}, _corrupt string", {"columnNameOfCorruptRecord": "_corrupt"})
    event_time = F.expr("try_cast(fields['event_time'] AS timestamp)")
    checks = [
        (F.col("fields")["event_id"].isNull(), "event_id missing"),
        (F.expr("try_cast(fields['account_id'] AS bigint)").isNull(), "account_id missing or not an integer"),
        (F.expr("try_cast(fields['amount_cents'] AS bigint)").isNull(), "amount_cents missing or not an integer"),
        (event_time.isNull(), "event_time missing or not a timestamp"),
    ]
    problems = F.concat_ws("; ", *[F.when(bad, F.lit(reason)) for bad, reason in checks])
    return (raw.select(F.col("partition").alias("kafka_partition"), F.col("offset").alias("kafka_offset"),
                       F.col("timestamp").alias("kafka_ts"), text.alias("raw"), fields.alias("fields"))
            .select("kafka_partition", "kafka_offset", "kafka_ts", "raw", "fields",
                    F.when(F.col("fields").isNull() | F.col("fields._corrupt").isNotNull(), F.lit("not a JSON object"))
                     .when(problems != "", problems).alias("reason"))
            .select("kafka_partition", "kafka_offset", "kafka_ts",
                    F.when(F.col("reason").isNotNull(), F.col("raw")).alias("raw"), "reason",
                    F.col("fields")["event_id"].alias("event_id"),
                    F.expr("try_cast(fields['account_id'] AS bigint)").alias("account_id"),
                    F.expr("try_cast(fields['amount_cents'] AS bigint)").alias("amount_cents"),
                    F.expr("unix_millis(try_cast(fields['event_time'] AS timestamp))").alias("event_ms")))


def process(parsed: DataFrame, run: RunConfig) -> DataFrame:
    """Every payments record of ``parsed`` (:func:`parse`) once through :class:`~oncekit.reference.processor.PaymentProcessor`:
    rows of kind ``balance``, ``total``, ``late`` and ``dead``, packed per call (schema ``PROCESSED_SCHEMA``;
    :func:`route` unpacks them).

    One branch from the source to the sink: a second branch for the dead letters would make
    Spark read the topic twice per batch. Duplicates (same event id) are dropped in the JVM
    before the processor, so the processor makes no state call per event; their watermark
    runs on the Kafka record time, which the log fixes: an upstream duplicate arrives within
    ``dedup_ttl_s`` of the first copy and is dropped whatever the batch boundaries, and a
    payment late by event time is not late here. Records that are not a payment keep their
    own (partition, offset) as dedup key and go to a group of their partition (negative
    keys; payments are grouped by ``account mod buckets``, never negative), with their
    numeric fields 0 instead of NULL so that the processor's pandas columns stay int64 (a
    NULL would turn a column into floats and large amounts inexact). The processor runs as
    applyInPandasWithState in append mode (the kit's sinks take appends): each row it
    emits is a fact of its batch, and the sinks turn balance and total rows into upserts by
    key."""
    from pyspark.sql import functions as F

    from oncekit.reference.processor import PROCESSED_SCHEMA, STATE_SCHEMA, PaymentProcessor

    good = F.col("reason").isNull()
    records = (parsed
               .withColumn("dedup_key", F.when(good, F.col("event_id")).otherwise(
                   F.format_string("dead:%d:%d", "kafka_partition", "kafka_offset")))
               .withColumn("group_key", F.when(good, F.pmod("account_id", F.lit(run.buckets)))
                           .otherwise(-1 - F.col("kafka_partition")))
               .withWatermark("kafka_ts", f"{run.dedup_ttl_s} seconds")
               .dropDuplicatesWithinWatermark(["dedup_key"])
               .select("group_key", *(F.coalesce(name, F.lit(0)).alias(name)
                                      for name in ("account_id", "amount_cents", "event_ms")),
                       "event_id", "kafka_partition", "kafka_offset", "raw", "reason"))
    return records.groupBy("group_key").applyInPandasWithState(
        PaymentProcessor(run.allowed_lateness_s * 1000), outputStructType=PROCESSED_SCHEMA,
        stateStructType=STATE_SCHEMA, outputMode="append", timeoutConf="NoTimeout")


def route(processed: DataFrame) -> DataFrame:
    """Every output row of ``processed`` (:func:`process`, packed as
    :data:`~oncekit.reference.processor.PROCESSED_SCHEMA`) in one frame, unpacked in the JVM,
    with the name of its target in ``target`` and the union of the targets' columns (each
    target takes its own; the rest are NULL). A balance row goes to two targets: the table and
    the topic."""
    from pyspark.sql import functions as F

    from oncekit.reference.processor import GIVEN, OUTPUT_COLUMNS

    names = [name for name, _ in OUTPUT_COLUMNS]
    kind = F.col("kind")
    column = {name: F.when(kind.isin(*(k for k, given in GIVEN.items() if name in given)), F.col(name))
              for name in names if name != "kind"}
    rows = processed.select(F.inline(F.arrays_zip(*names))).select(
        kind, *(value.alias(name) for name, value in column.items()))
    target = {"balance": F.array(F.lit("balances"), F.lit("balance_updates")), "total": F.array(F.lit("minute_totals")),
              "late": F.array(F.lit("late_events")), "dead": F.array(F.lit("dead_letters"))}
    routes = F.when(kind == "balance", target["balance"]).when(kind == "total", target["total"]) \
        .when(kind == "late", target["late"]).otherwise(target["dead"])
    return rows.select(
        F.explode(routes).alias("target"),
        "account_id", "balance_cents", "events", F.timestamp_millis("minute_ms").alias("minute"), "total_cents",
        "event_id", "amount_cents", F.timestamp_millis("event_ms").alias("event_time"),
        F.timestamp_millis("watermark_ms").alias("watermark"),
        F.col("account_id").cast("string").alias("key"),
        F.when(kind == "balance", F.to_json(F.struct("account_id", "balance_cents", "events"))).alias("value"),
        "kafka_partition", "kafka_offset", "raw", "reason")

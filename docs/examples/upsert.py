"""Upserts by key: each payment's row written in place, so a replayed batch writes the same rows
(the idempotent protocol; the table needs a unique index on the key)."""

import os

from oncekit import Trigger, kafka_stream, postgres_sink, spark_session, start_query

BOOTSTRAP = os.environ.get("ONCEKIT_KAFKA_BOOTSTRAP", "127.0.0.1:9092")
DSN = os.environ["ONCEKIT_POSTGRES_DSN"]
CHECKPOINTS = os.environ.get("CHECKPOINTS", "/tmp/oncekit-upsert")
TOPIC, TABLE = os.environ.get("TOPIC", "payments"), os.environ.get("TABLE", "payments")


def start(spark=None):
    spark = spark or spark_session("payments-upsert")  # fills only what the job and cluster left unset
    events = kafka_stream(spark, BOOTSTRAP, TOPIC, max_offsets_per_trigger=100_000)  # from the earliest offsets
    payments = events.selectExpr("CAST(value AS STRING) AS json").selectExpr(
        "get_json_object(json, '$.event_id') AS event_id",
        "try_cast(get_json_object(json, '$.account_id') AS INT) AS account_id",
        "try_cast(get_json_object(json, '$.amount_cents') AS BIGINT) AS amount_cents",
    ).where("event_id IS NOT NULL AND account_id IS NOT NULL AND amount_cents IS NOT NULL")  # not malformed
    sink = postgres_sink(DSN, TABLE, "idempotent", key_columns=("event_id",))
    # One key's rows in one partition: two tasks of a batch never write the same key.
    return start_query(payments.repartition("event_id"), sink, f"{CHECKPOINTS}/payments",
                       trigger=Trigger(processing_time="10 seconds"))

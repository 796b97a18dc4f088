"""The same job as a warm standby: start it on a second host with ``oncekit run standby.py``
(or ``oncekit run quickstart.py --standby CHECKPOINT``); it warms Spark up, waits until the
active driver's lease lapses, and takes over within seconds."""

import os

from oncekit import Trigger, kafka_stream, postgres_sink, stand_by, start_query

BOOTSTRAP = os.environ.get("ONCEKIT_KAFKA_BOOTSTRAP", "127.0.0.1:9092")
DSN = os.environ["ONCEKIT_POSTGRES_DSN"]
CHECKPOINTS = os.environ.get("CHECKPOINTS", "/tmp/oncekit-quickstart")
TOPIC, TABLE = os.environ.get("TOPIC", "payments"), os.environ.get("TABLE", "payments")


def start(spark):
    events = kafka_stream(spark, BOOTSTRAP, TOPIC).selectExpr("CAST(value AS STRING) AS json")
    payments = events.selectExpr(
        "get_json_object(json, '$.event_id') AS event_id",
        "try_cast(get_json_object(json, '$.account_id') AS INT) AS account_id",
        "try_cast(get_json_object(json, '$.amount_cents') AS BIGINT) AS amount_cents",
    ).where("event_id IS NOT NULL AND account_id IS NOT NULL AND amount_cents IS NOT NULL")  # not malformed; analyzed now, while the active driver runs
    checkpoint = f"{CHECKPOINTS}/payments"
    stand_by(spark, [checkpoint])  # warm up, then wait for the lease
    return start_query(payments, postgres_sink(DSN, TABLE, "two-phase-commit"), checkpoint,
                       trigger=Trigger(processing_time="5 seconds"))

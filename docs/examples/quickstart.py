"""Payment events from Kafka into PostgreSQL, exactly once: ``oncekit run quickstart.py``."""

import os

from oncekit import Trigger, kafka_stream, postgres_sink, start_query

BOOTSTRAP = os.environ.get("ONCEKIT_KAFKA_BOOTSTRAP", "127.0.0.1:9092")
DSN = os.environ["ONCEKIT_POSTGRES_DSN"]  # postgresql://user:password@host:5432/db
CHECKPOINTS = os.environ.get("CHECKPOINTS", "/tmp/oncekit-quickstart")
TOPIC, TABLE = os.environ.get("TOPIC", "payments"), os.environ.get("TABLE", "payments")


def start(spark):
    events = kafka_stream(spark, BOOTSTRAP, TOPIC).selectExpr("CAST(value AS STRING) AS json")
    payments = events.selectExpr(
        "get_json_object(json, '$.event_id') AS event_id",
        "try_cast(get_json_object(json, '$.account_id') AS INT) AS account_id",
        "try_cast(get_json_object(json, '$.amount_cents') AS BIGINT) AS amount_cents",
    ).where("event_id IS NOT NULL AND account_id IS NOT NULL AND amount_cents IS NOT NULL")  # not malformed
    sink = postgres_sink(DSN, TABLE, "two-phase-commit")
    return start_query(payments, sink, f"{CHECKPOINTS}/payments", trigger=Trigger(processing_time="5 seconds"))


if __name__ == "__main__":  # spark-submit quickstart.py [--standby]: what oncekit run gives, from the job's own file
    import sys

    import oncekit

    oncekit.run(start, standby=[f"{CHECKPOINTS}/payments"] if "--standby" in sys.argv else ())

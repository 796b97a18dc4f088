"""One query, one checkpoint, two outputs: every payment into a table (two-phase commit) and an
update per account into a topic (transactional), each exactly once."""

import os

from oncekit import fan_out, kafka_sink, kafka_stream, postgres_sink, start_query

BOOTSTRAP = os.environ.get("ONCEKIT_KAFKA_BOOTSTRAP", "127.0.0.1:9092")
DSN = os.environ["ONCEKIT_POSTGRES_DSN"]
CHECKPOINTS = os.environ.get("CHECKPOINTS", "/tmp/oncekit-fan-out")
TOPIC, TABLE = os.environ.get("TOPIC", "payments"), os.environ.get("TABLE", "payments")
UPDATES = os.environ.get("UPDATES_TOPIC", "payment-updates")


def start(spark):
    events = kafka_stream(spark, BOOTSTRAP, TOPIC).selectExpr("CAST(value AS STRING) AS json")
    payments = events.selectExpr(
        "get_json_object(json, '$.event_id') AS event_id",
        "get_json_object(json, '$.account_id') AS account_id",
        "try_cast(get_json_object(json, '$.amount_cents') AS BIGINT) AS amount_cents",
    ).where("event_id IS NOT NULL AND account_id IS NOT NULL AND amount_cents IS NOT NULL")  # not malformed
    rows = payments.selectExpr(
        "explode(array('table', 'topic')) AS target",  # every payment goes to both targets
        "event_id", "try_cast(account_id AS INT) AS account_id", "amount_cents",
        "account_id AS key", "to_json(named_struct('event_id', event_id, 'amount_cents', amount_cents)) AS value",
    )
    sink = fan_out({
        "table": postgres_sink(DSN, TABLE, "two-phase-commit", columns=("event_id", "account_id", "amount_cents")),
        "topic": kafka_sink(BOOTSTRAP, UPDATES, "transactional", columns=("key", "value")),
    }, route_column="target")
    return start_query(rows, sink, f"{CHECKPOINTS}/payments")

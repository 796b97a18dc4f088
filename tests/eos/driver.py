"""A driver process for crash tests that must kill the user's driver (where the listener runs).

    python -m tests.eos.driver <sink: postgres|kafka> <protocol> <bootstrap> <topic> <target> <checkpoint>

The PostgreSQL DSN comes from ONCEKIT_TEST_DSN. Exits 0 when the input is drained and every
completed checkpoint is committed; a crash point exits the process with CRASH_EXIT_CODE.
"""

from __future__ import annotations

import os
import sys

from oncekit.connectors import KafkaConfig
from oncekit.core.spark import spark_session
from oncekit.sinks.base import SinkConfig
from oncekit.sinks.kafka import kafka_sink
from oncekit.sinks.postgres import postgres_sink
from tests.eos.pipeline import PER_BATCH, integers, run_available_now


def main(kind: str, protocol: str, bootstrap: str, topic: str, target: str, checkpoint: str) -> None:
    spark = spark_session("oncekit-eos-driver")
    frame = integers(spark, KafkaConfig(bootstrap), topic, PER_BATCH)
    sink: SinkConfig
    if kind == "postgres":
        sink = postgres_sink(os.environ["ONCEKIT_TEST_DSN"], target, protocol)
    else:
        sink = kafka_sink(bootstrap, target, protocol)
        frame = frame.selectExpr("CAST(id AS STRING) AS value")
    run_available_now(frame, sink, checkpoint, notify=True)
    spark.stop()


if __name__ == "__main__":
    main(*sys.argv[1:7])

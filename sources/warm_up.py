"""What a standby's warm-up runs for the kit's Kafka source and sinks: the ``modules`` and
``analyze`` of :func:`oncekit.core.spark.standby.warm_up`. Importing it needs no Spark."""

from __future__ import annotations

from typing import Any

WARM_UP_MODULES = ("oncekit.sinks.kafka", "oncekit.sinks.postgres", "oncekit.sources._spark_kafka")
"""What a standby's warm-up imports in Spark's task workers for the kit's own sources and sinks
(:func:`oncekit.core.spark.standby.stand_by`'s ``modules``)."""
WARM_UP_SERVERS = "warm-up.invalid:9092"
"""The bootstrap servers of the warm-up's frame: no broker is asked, and no status page."""


def analyze_for_warm_up(spark: Any) -> None:
    """A standby's warm-up ``analyze``: a frame of the kit's Kafka source, analyzed only (its
    schema needs no broker), so Spark's Python data source planner processes start."""
    from oncekit.sources.kafka import kafka_stream

    kafka_stream(spark, WARM_UP_SERVERS, "warm-up")

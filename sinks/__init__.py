"""Sinks for PostgreSQL (``postgres/``) and Kafka (``kafka/``), one module per protocol, built on
the protocol bases of :mod:`oncekit.core.protocol`. May import core (not core.spark),
connectors and the client libraries; pyspark only in ``_spark.py``, the Spark data sources.
"""

from __future__ import annotations

from typing import Any


def register(spark: Any) -> None:
    """Make ``df.writeStream.format("oncekit-postgres")`` and ``format("oncekit-kafka-sink")``
    known to ``spark`` (``start_query`` registers the one it needs by itself)."""
    from oncekit.core.spark.session import register_data_source
    from oncekit.sinks._spark import DATA_SOURCES

    for source in DATA_SOURCES:
        register_data_source(spark, source)

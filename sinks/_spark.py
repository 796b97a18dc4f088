"""Every sink's Spark data source, for :func:`oncekit.sinks.register`. Each sink package keeps its
own in its ``_spark.py``, so that a job writing to Kafka never imports the PostgreSQL client."""

from __future__ import annotations

from oncekit.core.spark.writer import SinkDataSource
from oncekit.sinks.kafka._spark import KafkaSinkDataSource
from oncekit.sinks.postgres._spark import PostgresDataSource

DATA_SOURCES: tuple[type[SinkDataSource], ...] = (PostgresDataSource, KafkaSinkDataSource)

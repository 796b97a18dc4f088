"""Spark data sources for oncekit's sinks: ``format("oncekit-postgres")``, ``format("oncekit-kafka-sink")``."""

from __future__ import annotations

from oncekit.core.spark.writer import SinkDataSource
from oncekit.sinks.kafka.config import KafkaSinkConfig
from oncekit.sinks.postgres.config import PostgresSinkConfig


class PostgresDataSource(SinkDataSource):
    config_type = PostgresSinkConfig


class KafkaSinkDataSource(SinkDataSource):
    config_type = KafkaSinkConfig


DATA_SOURCES: tuple[type[SinkDataSource], ...] = (PostgresDataSource, KafkaSinkDataSource)

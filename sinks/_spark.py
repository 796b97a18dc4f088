"""Spark data sources for oncekit's sinks: ``format("oncekit-postgres")``, ``format("oncekit-kafka-sink")``."""

from __future__ import annotations

from pyspark.sql.datasource import DataSource, DataSourceStreamWriter
from pyspark.sql.types import StructType

from oncekit.core.spark.writer import stream_writer
from oncekit.sinks.kafka.config import KafkaSinkConfig
from oncekit.sinks.postgres.config import PostgresSinkConfig


class PostgresDataSource(DataSource):
    @classmethod
    def name(cls) -> str:
        return PostgresSinkConfig.format_name

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        return stream_writer(PostgresSinkConfig, dict(self.options), schema)


class KafkaSinkDataSource(DataSource):
    @classmethod
    def name(cls) -> str:
        return KafkaSinkConfig.format_name

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        return stream_writer(KafkaSinkConfig, dict(self.options), schema)


DATA_SOURCES: tuple[type[DataSource], ...] = (PostgresDataSource, KafkaSinkDataSource)

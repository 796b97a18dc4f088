"""The Spark data source ``format("oncekit-postgres")``; the only module of the package that imports pyspark."""

from __future__ import annotations

from oncekit.core.spark.writer import SinkDataSource
from oncekit.sinks.postgres.config import PostgresSinkConfig


class PostgresDataSource(SinkDataSource):
    config_type = PostgresSinkConfig

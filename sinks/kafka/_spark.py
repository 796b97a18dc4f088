"""The Spark data source ``format("oncekit-kafka-sink")``; the only module of the package that imports pyspark."""

from __future__ import annotations

from oncekit.core.spark.writer import SinkDataSource
from oncekit.sinks.kafka.config import KafkaSinkConfig


class KafkaSinkDataSource(SinkDataSource):
    config_type = KafkaSinkConfig

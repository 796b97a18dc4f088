"""oncekit: exactly-once PySpark Structured Streaming pipelines from Kafka into Kafka and PostgreSQL.

The public surface: :func:`start_query`, :func:`kafka_stream`, :func:`postgres_sink`,
:func:`kafka_sink` and the errors. Importing ``oncekit`` loads neither Spark nor a client; each
of the four loads its own module on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from oncekit.core._lazy import lazy_attributes
from oncekit.core.errors import ConfigError, OncekitError, ServiceError

if TYPE_CHECKING:
    from oncekit.core.spark.query import start_query
    from oncekit.sinks.kafka import kafka_sink
    from oncekit.sinks.postgres import postgres_sink
    from oncekit.sources.kafka import kafka_stream

__version__ = "0.1.0"

_LAZY = {
    "start_query": "oncekit.core.spark.query",
    "kafka_stream": "oncekit.sources.kafka",
    "postgres_sink": "oncekit.sinks.postgres",
    "kafka_sink": "oncekit.sinks.kafka",
}


__getattr__ = lazy_attributes(__name__, _LAZY)

__all__ = ["ConfigError", "OncekitError", "ServiceError", "__version__", "kafka_sink", "kafka_stream",
           "postgres_sink", "start_query"]

"""Per external system: client configuration, admin calls and preflight checks (``kafka``,
``postgres``, ``redact``: what runs inside jobs), and service start-up (``services/``).

May import core's errors and the client libraries; never sinks, sources or Spark.
"""

from __future__ import annotations

from oncekit.connectors.kafka import KafkaConfig
from oncekit.connectors.postgres import PostgresConfig
from oncekit.connectors.redact import redact_config, redact_dsn
from oncekit.connectors.services import start_services
from oncekit.connectors.services.base import KafkaService, PostgresService, Services

__all__ = [
    "KafkaConfig",
    "KafkaService",
    "PostgresConfig",
    "PostgresService",
    "Services",
    "redact_config",
    "redact_dsn",
    "start_services",
]

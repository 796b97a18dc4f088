"""Per external system: client configuration, admin calls and preflight checks (``kafka``,
``postgres``, ``redact``: what runs inside jobs), and service start-up (``services/``).

May import core's errors and the client libraries; never sinks, sources or Spark. The names
below load their module on first use, so a job that needs the Kafka client does not import
psycopg, testcontainers or the service backends (every Spark Python worker pays its imports).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from oncekit.core._lazy import lazy_attributes

if TYPE_CHECKING:
    from oncekit.connectors.kafka import KafkaConfig
    from oncekit.connectors.postgres import PostgresConfig
    from oncekit.connectors.redact import redact_config, redact_dsn
    from oncekit.connectors.services import start_services
    from oncekit.connectors.services.base import KafkaService, PostgresService, Services

_LAZY = {
    "KafkaConfig": "oncekit.connectors.kafka",
    "PostgresConfig": "oncekit.connectors.postgres",
    "redact_config": "oncekit.connectors.redact",
    "redact_dsn": "oncekit.connectors.redact",
    "start_services": "oncekit.connectors.services",
    "KafkaService": "oncekit.connectors.services.base",
    "PostgresService": "oncekit.connectors.services.base",
    "Services": "oncekit.connectors.services.base",
}


__getattr__ = lazy_attributes(__name__, _LAZY)

__all__ = ["KafkaConfig", "KafkaService", "PostgresConfig", "PostgresService", "Services", "redact_config",
           "redact_dsn", "start_services"]

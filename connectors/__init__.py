"""Per external system: client configuration, admin calls, preflight checks and service start-up."""

from __future__ import annotations

from oncekit.connectors.base import KafkaService, PostgresService, Services, redact_config, redact_dsn
from oncekit.connectors.kafka import KafkaConfig
from oncekit.connectors.postgres import PostgresConfig
from oncekit.connectors.services import start_services

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

"""The external backend: the user's own broker and database, named by environment variables.

``ONCEKIT_KAFKA_BOOTSTRAP`` (host:port[,host:port]) and ``ONCEKIT_POSTGRES_DSN``. Nothing is
started or stopped; fault injection is refused with a clear error.
"""

from __future__ import annotations

import os
from typing import Any

from oncekit.connectors.services.base import KafkaService, PostgresService
from oncekit.core.errors import ConfigError, ServiceError


def _env(name: str) -> str:
    value = os.environ.get(name, "").strip()
    if not value:
        raise ConfigError(f"the external backend needs {name} set")
    return value


class _External:
    backend = "external"
    name: str

    def stop(self) -> None:
        raise ServiceError(f"{self.name}: the external backend does not stop the user's service")

    def start(self) -> None:
        raise ServiceError(f"{self.name}: the external backend does not start the user's service")

    def remove(self) -> None:
        """Nothing to remove: the service is the user's."""

    def state(self) -> dict[str, Any]:
        return {}


class ExternalKafka(_External, KafkaService):
    def __init__(self) -> None:
        self.bootstrap_servers = _env("ONCEKIT_KAFKA_BOOTSTRAP")


class ExternalPostgres(_External, PostgresService):
    def __init__(self) -> None:
        self.dsn = _env("ONCEKIT_POSTGRES_DSN")

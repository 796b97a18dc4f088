"""oncekit: exactly-once PySpark Structured Streaming pipelines from Kafka into Kafka and PostgreSQL."""

from __future__ import annotations

from oncekit.core.errors import ConfigError, OncekitError, ServiceError

__version__ = "0.1.0"

__all__ = ["ConfigError", "OncekitError", "ServiceError", "__version__"]

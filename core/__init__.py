"""The checkpoint engine: guarantees, journal, checkpoint-complete notifications, recovery,
crash points, the sink protocol base classes, restart strategies, savepoints, the Spark adapter.

Everything here but the Spark adapter imports without a running Spark.
"""

from __future__ import annotations

from oncekit.core.errors import ConfigError, OncekitError, ServiceError

__all__ = ["ConfigError", "OncekitError", "ServiceError"]

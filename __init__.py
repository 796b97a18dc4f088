"""oncekit: exactly-once PySpark Structured Streaming pipelines from Kafka into Kafka and PostgreSQL.

The public surface: :func:`kafka_stream` (the source), :func:`postgres_sink`, :func:`kafka_sink`
and :func:`fan_out` (the sinks), :func:`start_query` and the :class:`OncekitQuery` it returns,
:class:`Trigger`, :func:`spark_session`, :func:`supervise` with its restart strategies,
:func:`stand_by`, :func:`run` (a job's restarts, savepoints and standby from its own file), and every error (:class:`OncekitError` and its subclasses). Importing ``oncekit`` loads neither Spark nor a client; each name loads its own module on
first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from oncekit.core._lazy import lazy_attributes
from oncekit.core.errors import (
    AccessError,
    BadRecordError,
    CommitError,
    ConfigError,
    DataLossError,
    FencedError,
    LeaseLostError,
    NonDeterministicReplayError,
    OncekitError,
    PipelineError,
    QueryStuckError,
    RecordError,
    ReplayError,
    RestartsExhaustedError,
    SavepointError,
    ServiceError,
    SourceReadError,
    StallError,
    StateRescaleError,
    TaskInputCutError,
    UnsettledMarkerError,
    VerifyError,
)

if TYPE_CHECKING:
    from oncekit.core.fanout import fan_out
    from oncekit.core.restart import ExponentialBackoff, FailureRate, FixedDelay, NoRestart, supervise
    from oncekit.core.spark.query import OncekitQuery, Trigger, start_query
    from oncekit.core.spark.session import spark_session
    from oncekit.core.spark.standby import stand_by
    from oncekit.runner import run
    from oncekit.sinks.kafka import kafka_sink
    from oncekit.sinks.postgres import postgres_sink
    from oncekit.sources.kafka import kafka_stream

__version__ = "0.1.0"

_LAZY = {
    "start_query": "oncekit.core.spark.query",
    "OncekitQuery": "oncekit.core.spark.query",
    "Trigger": "oncekit.core.spark.query",
    "spark_session": "oncekit.core.spark.session",
    "stand_by": "oncekit.core.spark.standby",
    "supervise": "oncekit.core.restart",
    "NoRestart": "oncekit.core.restart",
    "FixedDelay": "oncekit.core.restart",
    "FailureRate": "oncekit.core.restart",
    "ExponentialBackoff": "oncekit.core.restart",
    "fan_out": "oncekit.core.fanout",
    "kafka_stream": "oncekit.sources.kafka",
    "postgres_sink": "oncekit.sinks.postgres",
    "kafka_sink": "oncekit.sinks.kafka",
    "run": "oncekit.runner",
}


__getattr__ = lazy_attributes(__name__, _LAZY)

__all__ = sorted([
    "AccessError", "BadRecordError", "CommitError", "ConfigError", "DataLossError", "FencedError",
    "LeaseLostError", "NonDeterministicReplayError", "OncekitError", "PipelineError", "QueryStuckError",
    "RecordError", "ReplayError", "RestartsExhaustedError", "SavepointError", "ServiceError",
    "SourceReadError", "StallError", "StateRescaleError", "TaskInputCutError", "UnsettledMarkerError",
    "VerifyError", "__version__", *_LAZY,
])


def __dir__() -> list[str]:
    return __all__

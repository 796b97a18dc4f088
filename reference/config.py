"""The reference pipeline's configuration: a TOML file (``pipeline.toml``) with command-line
overrides.

Called by ``oncekit demo`` through :func:`load`, and by ``oncekit pipeline``, ``oncekit savepoint``
and ``oncekit doctor`` through :func:`load_with_services`. The file has five tables, each optional
(the packaged ``pipeline.toml`` holds every default)::

    [services]    backend, kafka_bootstrap, postgres_dsn, kafka_client_config (or the ONCEKIT_* environment variables)
    [topics]      payments, balance_updates, partitions
    [tables]      balances, minute_totals, late_events, dead_letters
    [guarantees]  balances, minute_totals, balance_updates (the sink protocols)
    [pipeline]    checkpoint, max_offsets_per_trigger, dedup_ttl_s, allowed_lateness_s, trigger_s, buckets, source
    [restart]     a restart strategy: type = "fixed-delay", attempts = 3, delay_s = 1 ...

Overrides are dotted keys (``{"pipeline.checkpoint": "/tmp/cp"}``). Unknown keys are refused, so
a typo never silently falls back to a default. The DSN's password never reaches ``repr``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from oncekit.connectors.kafka import KafkaConfig

from oncekit.connectors.kafka_broker import client_properties
from oncekit.connectors.redact import redact_dsn
from oncekit.connectors.services import load_state
from oncekit.core.errors import ConfigError
from oncekit.core.restart import RestartStrategy, strategy_from_config
from oncekit.sinks.kafka.config import KafkaProtocol
from oncekit.sinks.postgres.config import PostgresProtocol
from oncekit.sources.kafka import CONNECTORS

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

DEFAULT_FILE = Path(__file__).with_name("pipeline.toml")
"""The packaged defaults (shipped in the wheel)."""

TOTALS_PROTOCOLS = ("idempotent", "write-ahead-log")
UPDATES_PROTOCOLS = ("transactional", "write-ahead-log")


@dataclass(frozen=True)
class ServicesConfig:
    """Where Kafka and PostgreSQL are. Empty addresses mean: the services oncekit starts
    (``backend``), or ``ONCEKIT_KAFKA_BOOTSTRAP`` / ``ONCEKIT_POSTGRES_DSN`` when set."""

    backend: str = "auto"
    kafka_bootstrap: str = ""
    postgres_dsn: str = field(default="", repr=False)
    kafka_client_config: str = ""  # a file of librdkafka settings (security), see kafka_config()

    def __repr__(self) -> str:
        return (f"ServicesConfig(backend={self.backend!r}, kafka_bootstrap={self.kafka_bootstrap!r}, "
                f"postgres_dsn={redact_dsn(self.postgres_dsn)!r}, kafka_client_config={self.kafka_client_config!r})")


@dataclass(frozen=True)
class TopicsConfig:
    payments: str = "payments"
    balance_updates: str = "balance-updates"
    partitions: int = 2


@dataclass(frozen=True)
class TablesConfig:
    balances: str = "balances"
    minute_totals: str = "minute_totals"
    late_events: str = "late_events"
    dead_letters: str = "dead_letters"


@dataclass(frozen=True)
class GuaranteesConfig:
    """The sink protocol of each output. Balances are fixed by the design (two-phase commit);
    balance updates go out by Kafka transactions or by the write-ahead log; per-minute totals may use either exactly-once
    protocol that merges by key."""

    balances: PostgresProtocol = "two-phase-commit"
    minute_totals: PostgresProtocol = "idempotent"
    balance_updates: KafkaProtocol = "transactional"


@dataclass(frozen=True)
class RunConfig:
    """How the pipeline runs. ``trigger_s`` 0 means: drain what is in the topic, then stop."""

    checkpoint: str = ".oncekit/pipeline/checkpoint"
    max_offsets_per_trigger: int = 2000
    dedup_ttl_s: int = 3600
    allowed_lateness_s: int = 60
    trigger_s: float = 0.0
    buckets: int = 32
    source: str = "oncekit"
    """Who reads the payments topic: ``"oncekit"`` or ``"spark"`` (Spark's own Kafka source,
    :func:`~oncekit.sources.kafka.kafka_stream`'s ``connector``)."""


@dataclass(frozen=True)
class PipelineConfig:
    """Everything the reference pipeline needs; build with :func:`load`."""

    services: ServicesConfig = ServicesConfig()
    topics: TopicsConfig = TopicsConfig()
    tables: TablesConfig = TablesConfig()
    guarantees: GuaranteesConfig = GuaranteesConfig()
    pipeline: RunConfig = RunConfig()
    restart: Mapping[str, Any] = field(default_factory=lambda: {"type": "fixed-delay", "attempts": 3, "delay_s": 1})

    def __post_init__(self) -> None:
        if self.guarantees.balances != "two-phase-commit":
            raise ConfigError("guarantees.balances: the reference pipeline writes balances with two-phase-commit")
        if self.guarantees.balance_updates not in UPDATES_PROTOCOLS:
            raise ConfigError(f"guarantees.balance_updates must be one of {', '.join(UPDATES_PROTOCOLS)}, "
                              f"got {self.guarantees.balance_updates!r}")
        if self.pipeline.source not in CONNECTORS:
            raise ConfigError(f"pipeline.source must be one of {', '.join(CONNECTORS)}, got {self.pipeline.source!r}")
        if self.guarantees.minute_totals not in TOTALS_PROTOCOLS:
            raise ConfigError(f"guarantees.minute_totals must be one of {', '.join(TOTALS_PROTOCOLS)}, "
                              f"got {self.guarantees.minute_totals!r}")
        if self.pipeline.max_offsets_per_trigger <= 0 or self.topics.partitions <= 0:
            raise ConfigError("pipeline.max_offsets_per_trigger and topics.partitions must be positive")
        if self.pipeline.buckets <= 0:
            raise ConfigError("pipeline.buckets must be positive")
        if self.pipeline.dedup_ttl_s <= 0 or self.pipeline.allowed_lateness_s < 0:
            raise ConfigError("pipeline.dedup_ttl_s must be positive and pipeline.allowed_lateness_s not negative")
        self.restart_strategy()  # validates the [restart] table now, not at the first failure

    def restart_strategy(self) -> RestartStrategy:
        return strategy_from_config(self.restart)

    def kafka_bootstrap(self) -> str:
        return self.services.kafka_bootstrap or os.environ.get("ONCEKIT_KAFKA_BOOTSTRAP", "")

    def postgres_dsn(self) -> str:
        return self.services.postgres_dsn or os.environ.get("ONCEKIT_POSTGRES_DSN", "")

    def kafka_config(self) -> KafkaConfig:
        """The cluster and its client settings: the librdkafka settings (``key=value`` lines:
        security protocol, SASL, CA) of the file ``[services] kafka_client_config`` or
        ``ONCEKIT_KAFKA_CLIENT_CONFIG`` names, none when neither is set. A file, so that the
        password stays out of the pipeline's configuration and off command lines."""
        path = self.services.kafka_client_config or os.environ.get("ONCEKIT_KAFKA_CLIENT_CONFIG", "")
        return KafkaConfig(self.kafka_bootstrap(), client_properties(path) if path else {})

    def with_services(self, kafka_bootstrap: str, postgres_dsn: str) -> PipelineConfig:
        """The same configuration pointed at running services (the demo's own)."""
        return replace(self, services=replace(self.services, kafka_bootstrap=kafka_bootstrap, postgres_dsn=postgres_dsn))


_SECTIONS: dict[str, type[Any]] = {
    "services": ServicesConfig,
    "topics": TopicsConfig,
    "tables": TablesConfig,
    "guarantees": GuaranteesConfig,
    "pipeline": RunConfig,
}


def _section(name: str, kind: type[Any], values: Mapping[str, Any]) -> Any:
    known = {f.name: f for f in fields(kind)}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ConfigError(f"[{name}]: unknown key(s) {', '.join(unknown)}; known: {', '.join(known)}")
    converted = {}
    for key, value in values.items():
        default = getattr(kind(), key)
        try:
            converted[key] = type(default)(value)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"[{name}] {key}: expected {type(default).__name__}, got {value!r}") from exc
    return kind(**converted)


def _parse(text: str, where: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{where}: not valid TOML: {exc}") from exc


def load(path: str | Path | None = None, overrides: Mapping[str, Any] | None = None) -> PipelineConfig:
    """The packaged defaults, then the file at ``path`` (if given), then ``overrides`` (dotted
    keys, e.g. from command-line flags; ``None`` values are skipped)."""
    data = _parse(DEFAULT_FILE.read_text(), str(DEFAULT_FILE))
    if path is not None:
        if not Path(path).is_file():
            raise ConfigError(f"pipeline config {path} does not exist")
        for section, values in _parse(Path(path).read_text(), str(path)).items():
            if not isinstance(values, dict):
                raise ConfigError(f"{path}: {section} must be a table ([{section}])")
            if section == "restart":  # a strategy table replaces the default one as a whole
                data["restart"] = dict(values)
            else:
                data.setdefault(section, {}).update(values)
    for dotted, value in (overrides or {}).items():
        if value is None:
            continue
        section, _, key = dotted.partition(".")
        if not key:
            raise ConfigError(f"override {dotted!r}: give section.key")
        data.setdefault(section, {})[key] = value
    unknown = sorted(set(data) - set(_SECTIONS) - {"restart"})
    if unknown:
        raise ConfigError(f"pipeline config: unknown table(s) {', '.join(unknown)}; known: {', '.join([*_SECTIONS, 'restart'])}")
    sections = {name: _section(name, kind, data.get(name, {})) for name, kind in _SECTIONS.items()}
    return PipelineConfig(**sections, restart=dict(data.get("restart", {"type": "none"})))


def load_with_services(path: str | Path | None = None, overrides: Mapping[str, Any] | None = None) -> PipelineConfig:
    """:func:`load`, with the addresses it leaves empty taken from the services that
    ``oncekit services up`` started (when it did)."""
    loaded = load(path, overrides)
    if not (loaded.kafka_bootstrap() and loaded.postgres_dsn()):
        running = load_state()
        if running is not None:
            loaded = loaded.with_services(loaded.kafka_bootstrap() or running.kafka.bootstrap_servers,
                                          loaded.postgres_dsn() or running.postgres.dsn)
    return loaded

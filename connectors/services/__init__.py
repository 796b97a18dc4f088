"""Start, find and stop the services oncekit's tests, demo and CLI run against (Kafka, PostgreSQL,
a Spark standalone cluster): containers, local processes or the user's own.

``start_services(backend)`` is the one entry point; ``backend`` is ``containers`` (testcontainers
on Docker or Podman), ``local`` (local processes), ``external`` (the user's own) or ``auto``
(containers where an engine answers, else local). The CLI keeps what it started in a state file
so that ``oncekit services down`` in another process can find it.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from oncekit.connectors.redact import redact_dsn
from oncekit.connectors.services.base import KafkaService, PostgresService, Services
from oncekit.core.errors import ConfigError, OncekitError, ServiceError

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "containers", "local", "external")


def resolve_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ConfigError(f"unknown services backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend != "auto":
        return backend
    from oncekit.connectors.services.containers import engine_answers

    return "containers" if engine_answers() else "local"


def start_secured_services() -> Services:
    """The local backend's secured pair, as production runs them: a Kafka broker whose only
    client listener is SASL_SSL (SCRAM-SHA-256) and a PostgreSQL server that takes only TLS with
    scram-sha-256, both serving certificates of a CA made here for them. Clients trust that CA
    alone (the service handles carry its certificate's path: the broker's ``client`` settings,
    the server's DSN with ``sslmode=verify-full``); its private key is deleted once both
    certificates are signed."""
    import tempfile

    from oncekit.connectors.services.local import LocalPostgres, SecuredLocalKafka
    from oncekit.connectors.services.tls import CertificateAuthority

    with tempfile.TemporaryDirectory(prefix="oncekit-ca-") as folder:
        ca = CertificateAuthority.create(Path(folder))
        kafka = SecuredLocalKafka.secured(ca)
        try:
            postgres = LocalPostgres.create(ca)
        except BaseException:
            kafka.remove()
            raise
    return Services("local", kafka, postgres)


def start_services(backend: str = "auto", kafka_brokers: int = 1, secured: bool = False,
                   max_prepared_transactions: int | None = None) -> Services:
    """Start (or, for ``external``, find) Kafka and a PostgreSQL server and wait until both are
    ready: every broker answers metadata, a transactional producer initialises, the server
    accepts a connection. ``kafka_brokers``: 1 (the default, fastest), or a KRaft cluster of 3 or
    more, replicated as in production (see :func:`~oncekit.connectors.kafka.broker_properties`).
    A failure raises ServiceError and leaves nothing running. ``secured``: the local backend's
    secured pair (:func:`start_secured_services`), one broker. ``max_prepared_transactions``: the
    PostgreSQL server's, when not :data:`~oncekit.connectors.postgres.MAX_PREPARED_TRANSACTIONS`
    (two batches of two-phase commit hold up to twice their writer partitions)."""
    if secured:
        if backend not in ("auto", "local") or kafka_brokers != 1:
            raise ConfigError("secured services: the local backend with one broker only")
        return start_secured_services()
    chosen = resolve_backend(backend)
    if chosen == "external":
        from oncekit.connectors.services.external import ExternalKafka, ExternalPostgres

        services = Services(chosen, ExternalKafka(), ExternalPostgres())
        services.kafka.wait_ready(30)
        services.postgres.wait_ready(30)
        return services
    kafka = start_kafka(chosen, kafka_brokers)
    try:
        prepared = {} if max_prepared_transactions is None else {"max_prepared_transactions": max_prepared_transactions}
        postgres = _postgres_type(chosen).create(**prepared)
    except BaseException:
        kafka.remove()
        raise
    return Services(chosen, kafka, postgres)


def start_kafka(backend: str = "auto", brokers: int = 1, settings: Mapping[str, str] | None = None) -> KafkaService:
    """Start Kafka alone (``brokers`` brokers) with ``backend`` (not ``external``): for tests that
    need a second cluster beside the services they already have, or a broker with other
    ``settings`` (server properties over :func:`~oncekit.connectors.kafka.broker_properties`'s,
    such as ``offsets.retention.minutes``). Returns once it is ready."""
    chosen = resolve_backend(backend)
    if brokers != 1 and brokers < 3:
        raise ConfigError(f"kafka_brokers={brokers}: run 1 broker, or 3 or more (replication factor 3)")
    if chosen == "containers":
        _require_engine()
        from oncekit.connectors.services.containers import ContainerKafka

        return ContainerKafka.create(brokers=brokers, settings=settings)
    if chosen == "local":
        from oncekit.connectors.services.local import LocalKafka

        return LocalKafka.create(brokers=brokers, settings=settings)
    raise ConfigError(f"the {chosen} backend starts no Kafka; point ONCEKIT_KAFKA_BOOTSTRAP at your cluster")


def _require_engine() -> None:
    from oncekit.connectors.services.containers import engine_answers

    if not engine_answers():
        raise ServiceError(
            "no container engine answers (start Docker, or run docker/podman/setup.sh and source .oncekit/engine.env)"
        )


def _postgres_type(backend: str) -> Any:
    if backend == "containers":
        from oncekit.connectors.services.containers import ContainerPostgres

        return ContainerPostgres
    from oncekit.connectors.services.local import LocalPostgres

    return LocalPostgres


def state_file() -> Path:
    return Path(os.environ.get("ONCEKIT_STATE_DIR", ".oncekit")) / "services.json"


def save_state(services: Services) -> Path:
    """Write what ``load_state`` needs (ids, ports, the generated password) to a 0600 file."""
    path = state_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"backend": services.backend, "kafka": services.kafka.state(), "postgres": services.postgres.state()}
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump(payload, out)
    return path


def load_state() -> Services | None:
    """The services a previous ``oncekit services up`` started, or None."""
    path = state_file()
    if not path.exists():
        return None
    payload = json.loads(path.read_text())
    backend = payload["backend"]
    if backend == "containers":
        from oncekit.connectors.services.containers import ContainerKafka, ContainerPostgres

        return Services(backend, ContainerKafka.from_state(payload["kafka"]), ContainerPostgres.from_state(payload["postgres"]))
    if backend == "local":
        from oncekit.connectors.services.local import LocalKafka, LocalPostgres, SecuredLocalKafka

        kafka_type = SecuredLocalKafka if "password" in payload["kafka"] else LocalKafka
        return Services(backend, kafka_type.from_state(payload["kafka"]), LocalPostgres.from_state(payload["postgres"]))
    from oncekit.connectors.services.external import ExternalKafka, ExternalPostgres

    return Services(backend, ExternalKafka(), ExternalPostgres())


def service_addresses(bootstrap: str | None, dsn: str | None) -> tuple[str, str]:
    """The Kafka bootstrap servers and PostgreSQL DSN a command works with: those given, else
    ``ONCEKIT_KAFKA_BOOTSTRAP`` and ``ONCEKIT_POSTGRES_DSN``, else the services ``oncekit
    services up`` started; "" for one found nowhere. Called by ``oncekit doctor``, ``oncekit
    status`` and ``oncekit run --ui``."""
    bootstrap = bootstrap or os.environ.get("ONCEKIT_KAFKA_BOOTSTRAP", "")
    dsn = dsn or os.environ.get("ONCEKIT_POSTGRES_DSN", "")
    if not (bootstrap and dsn):
        running = load_state()
        if running is not None:
            bootstrap, dsn = bootstrap or running.kafka.bootstrap_servers, dsn or running.postgres.dsn
    return bootstrap, dsn


def forget_state() -> None:
    state_file().unlink(missing_ok=True)


def command(action: str, backend: str, show_dsn: bool = False, brokers: int = 1, secured: bool = False) -> int:
    """``oncekit services up|down|status``: start (``brokers`` Kafka brokers) and remember, stop
    and forget, or check the services; prints the bootstrap servers and the DSN with its
    password hidden unless ``show_dsn``. Returns the exit code: 1 when ``status`` finds a service
    not ready, or nothing started."""
    current = load_state()
    ready = True
    if action == "up":
        if current is not None:
            print(f"services already up ({current.backend}); run 'oncekit services down' first", file=sys.stderr)
            return 1
        current = start_services(backend, kafka_brokers=brokers, secured=secured)
        path = save_state(current)
        print(f"backend: {current.backend}  (state in {path})")
    elif current is None:
        print("no services started by 'oncekit services up'")
        return 0 if action == "down" else 1
    elif action == "down":
        current.remove()
        forget_state()
        print(f"services down ({current.backend})")
        return 0
    else:
        for service in (current.kafka, current.postgres):
            try:
                service.wait_ready(timeout_s=5)
                print(f"{service.name}: ready")
            except OncekitError as exc:
                ready = False
                print(f"{service.name}: NOT READY: {exc}")
    print(f"kafka bootstrap: {current.kafka.bootstrap_servers}")
    client_config = getattr(current.kafka, "client_config", None)  # secured services only
    if client_config is not None:
        print(f"kafka client:    {client_config}  (librdkafka settings with the password; ONCEKIT_KAFKA_CLIENT_CONFIG)")
    print(f"postgres dsn:    {current.postgres.dsn if show_dsn else redact_dsn(current.postgres.dsn)}")
    return 0 if ready else 1

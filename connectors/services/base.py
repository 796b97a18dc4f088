"""The contract every service backend keeps, and the waiting and port helpers they share.

A backend (containers, local processes, external) hands out one :class:`KafkaService` and one
:class:`PostgresService`. Tests and the CLI talk only to these handles: they never know whether
a broker is a container, a local JVM or the user's own cluster.
"""

from __future__ import annotations

import socket
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing, contextmanager
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from oncekit.connectors.kafka import KafkaConfig

from oncekit.connectors.kafka_admin import check_broker
from oncekit.connectors.postgres import check_server
from oncekit.connectors.redact import redact_dsn
from oncekit.connectors.wait import wait_until
from oncekit.core.errors import ServiceError


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports of :func:`free_port` (each call alone may repeat an earlier one)."""
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


def port_in_use(port: int) -> bool:
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


class Service(ABC):
    """One running external service. Faults for tests go through :meth:`stop`, :meth:`start`,
    :meth:`restart`, :meth:`disconnect` and :meth:`reconnect`; a backend that cannot inject a
    fault raises ServiceError naming it."""

    name: str
    backend: str

    @abstractmethod
    def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Block until the service answers as clients need it; ServiceError after the timeout."""

    @abstractmethod
    def stop(self) -> None:
        """Stop the service, keeping its data, so that :meth:`start` brings it back as it was."""

    @abstractmethod
    def start(self) -> None:
        """Start a stopped service on the same address and wait until it is ready."""

    def restart(self) -> None:
        self.stop()
        self.start()

    def outage(self, how: str, seconds: float) -> None:
        """Take the service away for ``seconds`` and bring it back ready: ``stop`` (a clean
        stop), ``kill`` (SIGKILL; the start goes through crash recovery) or ``cut`` (off the
        network while it runs). Called by the campaign's service and broker faults."""
        if how not in ("stop", "kill", "cut"):
            raise ServiceError(f"{self.name}: unknown outage {how!r}; choose stop, kill or cut")
        if how == "cut":
            self.disconnect()
            time.sleep(seconds)
            self.reconnect()
            self.wait_ready()
            return
        if how == "kill":
            self.kill()
        else:
            self.stop()
        time.sleep(seconds)
        self.start()

    def kill(self) -> None:
        """SIGKILL every process of the service at once, as an OOM kill or a crashed host would,
        keeping its data: :meth:`start` brings it back through the service's crash recovery."""
        raise ServiceError(f"{self.name}: the {self.backend} backend cannot kill the service")

    def disconnect(self) -> None:
        """Cut the service off from the network while it keeps running."""
        raise ServiceError(f"{self.name}: the {self.backend} backend cannot cut a service off the network")

    def reconnect(self) -> None:
        raise ServiceError(f"{self.name}: the {self.backend} backend cannot cut a service off the network")

    @abstractmethod
    def remove(self) -> None:
        """Stop the service for good and delete its data (nothing for an external service)."""

    @abstractmethod
    def state(self) -> dict[str, Any]:
        """What the CLI must remember to find this service again from another process."""


class KafkaService(Service):
    name = "kafka"
    bootstrap_servers: str
    node_id = 1
    client: Mapping[str, str] = MappingProxyType({})
    """librdkafka settings every client of this service needs (security protocol, SASL, the CA):
    none for a plaintext broker. Secret; never shown (see :attr:`config`'s repr)."""

    @property
    def config(self) -> KafkaConfig:
        """How clients reach this service: every client the kit's tests, harness and CLI build
        for it is made from this."""
        return KafkaConfig(self.bootstrap_servers, dict(self.client))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(bootstrap_servers={self.bootstrap_servers!r})"

    @property
    def brokers(self) -> list[KafkaService]:
        """The brokers one by one, by which faults hit a single broker (a leader, a transaction
        coordinator): a single broker is its own list."""
        return [self]

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        wait_until(lambda: check_broker(self.bootstrap_servers, self.client), timeout_s, f"kafka at {self.bootstrap_servers}")


class KafkaCluster(KafkaService):
    """Several brokers of one KRaft cluster behind one handle, made by a backend from handles of
    its own brokers. Clients get every broker's address as bootstrap servers. :meth:`stop`,
    :meth:`start`, :meth:`kill`, :meth:`disconnect` and :meth:`reconnect` act on every broker (the
    whole cluster gone, as the single-broker faults mean it); faults on one broker go through
    :attr:`brokers`. Brokers start together: none is ready before a majority of the controller
    quorum runs."""

    def __init__(self, brokers: Sequence[KafkaService] = (), backend: str = "") -> None:
        self._brokers: list[KafkaService] = []
        self.backend, self.bootstrap_servers = backend, ""
        for broker in brokers:
            self.add(broker)

    def add(self, broker: KafkaService) -> None:
        """Called by the backend as it starts each broker, so that a start-up that fails half way
        can remove what it started."""
        self._brokers.append(broker)
        self.backend = broker.backend
        self.bootstrap_servers = ",".join(b.bootstrap_servers for b in self._brokers)

    @property
    def brokers(self) -> list[KafkaService]:
        return list(self._brokers)

    def broker(self, node_id: int) -> KafkaService:
        """The broker with ``node_id`` (as the cluster's metadata names leaders and coordinators)."""
        for broker in self._brokers:
            if broker.node_id == node_id:
                return broker
        raise ServiceError(f"kafka: no broker with node id {node_id} in {self.bootstrap_servers}")

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Every broker is in the metadata and a transactional producer can initialise."""
        wait_until(lambda: check_broker(self.bootstrap_servers, self.client, brokers=len(self._brokers)), timeout_s,
                   f"kafka cluster at {self.bootstrap_servers}")

    def _each(self, action: Callable[[KafkaService], None]) -> None:
        """``action`` on every broker at once (threads: a broker's start waits for the others)."""
        with ThreadPoolExecutor(len(self._brokers)) as pool:
            for future in [pool.submit(action, broker) for broker in self._brokers]:
                future.result()

    def stop(self) -> None:
        self._each(lambda broker: broker.stop())

    def start(self) -> None:
        self._each(lambda broker: broker.start())
        self.wait_ready()

    def kill(self) -> None:
        self._each(lambda broker: broker.kill())

    def disconnect(self) -> None:
        self._each(lambda broker: broker.disconnect())

    def reconnect(self) -> None:
        self._each(lambda broker: broker.reconnect())

    def remove(self) -> None:
        errors = []
        for broker in self._brokers:
            try:
                broker.remove()
            except Exception as exc:  # remove the others all the same
                errors.append(f"broker {broker.node_id}: {exc}")
        if errors:
            raise ServiceError("kafka: could not remove " + "; ".join(errors))

    def state(self) -> dict[str, Any]:
        return {"brokers": [broker.state() for broker in self._brokers]}


class PostgresService(Service):
    name = "postgres"
    dsn: str

    def __repr__(self) -> str:
        return f"{type(self).__name__}(dsn={redact_dsn(self.dsn)!r})"

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        wait_until(lambda: check_server(self.dsn), timeout_s, f"postgres at {redact_dsn(self.dsn)}")


@dataclass(frozen=True)
class Services:
    """A Kafka broker and a PostgreSQL server started (or found) by one backend."""

    backend: str
    kafka: KafkaService
    postgres: PostgresService

    def __repr__(self) -> str:
        return (
            f"Services(backend={self.backend!r}, kafka={self.kafka.bootstrap_servers!r}, "
            f"postgres={redact_dsn(self.postgres.dsn)!r})"
        )

    def remove(self) -> None:
        errors = []
        for service in (self.kafka, self.postgres):
            try:
                service.remove()
            except Exception as exc:  # remove the other one all the same
                errors.append(f"{service.name}: {exc}")
        if errors:
            raise ServiceError("could not remove " + "; ".join(errors))

    @contextmanager
    def running(self) -> Iterator[Services]:
        try:
            yield self
        finally:
            self.remove()

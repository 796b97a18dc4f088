"""The container backend: testcontainers starts a KRaft broker (or a cluster of them) and a
PostgreSQL server.

With Docker and registry access the official images run (apache/kafka, postgres). Where no image
can be pulled, docker/podman/setup.sh builds look-alike images locally and points
``ONCEKIT_KAFKA_IMAGE`` / ``ONCEKIT_POSTGRES_IMAGE`` at them; both honour the official images'
environment variables, so this module does not know which it runs.

The broker maps a chosen free host port to the same container port and advertises
127.0.0.1:port, which spares the advertised-listener dance of testcontainers' KafkaContainer.

Brokers of a cluster also reach each other, and that cannot go through the host: inside a
container 127.0.0.1 is the container itself. Checked with Podman 4.3 (netavark, aardvark-dns),
rootful: containers on a user-defined network find each other by container name (the network's
DNS), while the host still reaches each broker on its own mapped port. So each cluster gets a
network of its own; every broker listens for clients on its host port (advertised as
127.0.0.1:port) and for the other brokers and the controller quorum on fixed container ports
advertised under its container name. Cutting a broker off that network cuts it off from the
other brokers and from clients alike, as a network partition would; reconnecting restores both.
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from oncekit.connectors.services.base import KafkaCluster, KafkaService, PostgresService, Service, free_port, free_ports
from oncekit.connectors.kafka_broker import CLUSTER_ID, JVM_OPTIONS, KAFKA_VERSION, BrokerAddress, broker_properties
from oncekit.connectors.postgres import MAX_PREPARED_TRANSACTIONS
from oncekit.core.errors import ServiceError

if TYPE_CHECKING:
    from docker.models.containers import Container

logger = logging.getLogger(__name__)


def kafka_image() -> str:
    return os.environ.get("ONCEKIT_KAFKA_IMAGE", f"apache/kafka:{KAFKA_VERSION}")


def postgres_image() -> str:
    return os.environ.get("ONCEKIT_POSTGRES_IMAGE", "postgres:15")


def engine_answers() -> bool:
    """Whether a Docker-API container engine (Docker, or Podman's API service) answers."""
    try:
        import docker

        client = docker.from_env(timeout=60)  # Podman answers /version slowly while it starts or stops containers
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:
        return False


def _engine() -> Any:
    import docker

    try:
        return docker.from_env(timeout=60)
    except Exception as exc:
        raise ServiceError(
            "no container engine answers (start Docker, or run docker/podman/setup.sh and source .oncekit/engine.env)"
        ) from exc


def _run(image: str, name: str, env: dict[str, str], ports: dict[int, int], command: list[str] | None,
         network: str | None = None) -> str:
    """Start a container with testcontainers (on ``network`` if given) and return its id; a
    failure names the image."""
    from testcontainers.core.container import DockerContainer

    container = DockerContainer(image, name=name).with_envs(**env)
    if command:
        container.with_command(command)
    if network:
        container.with_kwargs(network=network)
    for container_port, host_port in ports.items():
        container.with_bind_ports(container_port, host_port)
    try:
        container.start()
    except Exception as exc:
        raise ServiceError(f"cannot start container from image {image}: {exc}") from exc
    return container.get_container_id()


class _ContainerService(Service):
    """Stop, start and network cuts through the engine's API, shared by both services."""

    backend = "containers"
    container_id: str

    def _container(self) -> Container:
        return _engine().containers.get(self.container_id)

    def stop(self) -> None:
        logger.info("%s: stopping container %s", self.name, self.container_id[:12])
        self._container().stop(timeout=10)

    def start(self) -> None:
        logger.info("%s: starting container %s", self.name, self.container_id[:12])
        self._container().start()
        self.wait_ready()

    def kill(self) -> None:
        """SIGKILL the container's first process; the kernel then kills the rest of its PID
        namespace. The container's file system, and so the service's data, stays."""
        logger.info("%s: killing container %s", self.name, self.container_id[:12])
        container = self._container()
        container.kill(signal="SIGKILL")
        container.wait(timeout=60)

    def disconnect(self) -> None:
        container = self._container()
        self._network, endpoint = next(iter(container.attrs["NetworkSettings"]["Networks"].items()))
        self._address = endpoint.get("IPAddress") or None
        logger.info("%s: cutting container %s off network %s", self.name, self.container_id[:12], self._network)
        _engine().networks.get(self._network).disconnect(container)

    def reconnect(self) -> None:
        """Back on the network at the address it had: a partition that heals, not a host that
        moved. Podman hands a reconnected container a new address otherwise, while its peers'
        connections and cached names (Java keeps them 30 s) point at the old one: a 40-fault
        campaign could not commit its next input to the cluster for 30 s after a partition
        leader was cut off for 4 s and came back at a new address."""
        network = getattr(self, "_network", None) or "podman"
        address = getattr(self, "_address", None)
        logger.info("%s: reconnecting container %s to network %s at %s", self.name, self.container_id[:12], network,
                    address)
        _engine().networks.get(network).connect(self._container(), ipv4_address=address)

    def remove(self) -> None:
        try:
            self._container().remove(force=True, v=True)
        except Exception as exc:
            if type(exc).__name__ != "NotFound":
                raise ServiceError(f"{self.name}: cannot remove container {self.container_id[:12]}: {exc}") from exc


class ContainerKafka(_ContainerService, KafkaService):
    def __init__(self, container_id: str, port: int, node_id: int = 1, network: str | None = None) -> None:
        self.container_id, self.port, self.node_id = container_id, port, node_id
        self.bootstrap_servers = f"127.0.0.1:{port}"
        if network:
            self._network = network  # reconnect() puts a cluster's broker back on its cluster's network

    @classmethod
    def create(cls, image: str | None = None, brokers: int = 1, settings: Mapping[str, str] | None = None) -> KafkaService:
        """One broker on the engine's default network, or a :class:`ContainerKafkaCluster` of
        ``brokers`` brokers on a network of their own, with ``settings`` over the kit's server
        properties; returns once every broker is ready."""
        if brokers == 1:
            port, controller_port = free_ports(2)
            node = BrokerAddress(1, port, controller_port)
            kafka = cls._launch(image, node, (node,), None, settings)
            kafka.wait_ready()
            return kafka
        ports = free_ports(brokers)
        network = f"oncekit-kafka-{ports[0]}"
        # Fixed container ports for the quorum and the brokers: each container has its own.
        nodes = [BrokerAddress(i + 1, port, 9093, host=f"oncekit-kafka-{port}", internal_port=9094)
                 for i, port in enumerate(ports)]
        _engine().networks.create(network, driver="bridge")
        cluster = ContainerKafkaCluster([], network)
        try:
            for node in nodes:
                cluster.add(cls._launch(image, node, nodes, network, settings))
            cluster.wait_ready()
        except BaseException:
            cluster.remove()
            raise
        return cluster

    @classmethod
    def _launch(cls, image: str | None, node: BrokerAddress, cluster: Sequence[BrokerAddress],
                network: str | None, settings: Mapping[str, str] | None = None) -> ContainerKafka:
        properties = {**broker_properties(node, cluster, bind_host="0.0.0.0"), **(settings or {})}
        # The official image's convention: log.dirs -> KAFKA_LOG_DIRS, "_" -> "__", "-" -> "___".
        env = {
            "KAFKA_" + key.replace("-", "___").replace("_", "__").replace(".", "_").upper(): value
            for key, value in properties.items()
        }
        env["CLUSTER_ID"] = CLUSTER_ID
        env.update({name: os.environ[name] for name in JVM_OPTIONS if name in os.environ})
        name = f"oncekit-kafka-{node.port}"
        container_id = _run(image or kafka_image(), name, env, {node.port: node.port}, None, network)
        logger.info("kafka: container %s, node %s at 127.0.0.1:%s", container_id[:12], node.node_id, node.port)
        return cls(container_id, node.port, node.node_id, network)

    def state(self) -> dict[str, Any]:
        return {"container_id": self.container_id, "port": self.port, "node_id": self.node_id,
                "network": getattr(self, "_network", None)}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> KafkaService:
        if "brokers" in state:
            return ContainerKafkaCluster([cls.from_state(b) for b in state["brokers"]], state["network"])
        return cls(state["container_id"], state["port"], state.get("node_id", 1), state.get("network"))


class ContainerKafkaCluster(KafkaCluster):
    """A :class:`KafkaCluster` of containers and the network they share, removed with them."""

    def __init__(self, brokers: Sequence[KafkaService], network: str) -> None:
        super().__init__(brokers, "containers")
        self.network = network

    def remove(self) -> None:
        try:
            super().remove()
        finally:
            try:
                _engine().networks.get(self.network).remove()
            except Exception as exc:
                if type(exc).__name__ != "NotFound":
                    raise ServiceError(f"kafka: cannot remove network {self.network}: {exc}") from exc

    def state(self) -> dict[str, Any]:
        return {**super().state(), "network": self.network}


class ContainerPostgres(_ContainerService, PostgresService):
    def __init__(self, container_id: str, port: int, password: str) -> None:
        self.container_id, self.port, self._password = container_id, port, password
        self.dsn = f"postgresql://oncekit:{password}@127.0.0.1:{port}/oncekit"

    @classmethod
    def create(cls, image: str | None = None,
               max_prepared_transactions: int = MAX_PREPARED_TRANSACTIONS) -> ContainerPostgres:
        port, password = free_port(), secrets.token_urlsafe(16)
        env = {"POSTGRES_USER": "oncekit", "POSTGRES_PASSWORD": password, "POSTGRES_DB": "oncekit"}
        # fsync only matters for machine crashes; a killed or restarted server loses nothing without it.
        command = ["postgres", "-c", f"max_prepared_transactions={max_prepared_transactions}", "-c", "fsync=off"]
        container_id = _run(image or postgres_image(), f"oncekit-postgres-{port}", env, {5432: port}, command)
        postgres = cls(container_id, port, password)
        logger.info("postgres: container %s on port %s", container_id[:12], port)
        postgres.wait_ready()
        return postgres

    def stop(self) -> None:
        """A fast shutdown (SIGINT): the engine's stop sends SIGTERM, PostgreSQL's smart shutdown,
        which waits for the sinks' pooled sessions until the engine kills the server."""
        logger.info("%s: stopping container %s", self.name, self.container_id[:12])
        container = self._container()
        container.kill(signal="SIGINT")
        container.wait(timeout=60)

    def state(self) -> dict[str, Any]:
        return {"container_id": self.container_id, "port": self.port, "password": self._password}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> ContainerPostgres:
        return cls(state["container_id"], state["port"], state["password"])

"""A test Kafka cluster's own settings, one place for every services backend: the container
backend passes them as ``KAFKA_*`` environment variables (the official apache/kafka image's
convention), the local-process backend writes them to a properties file."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from oncekit.core.errors import ConfigError

KAFKA_VERSION = "4.2.1"
"""The Kafka release oncekit tests against; docker/kafka/pom.xml pins the same."""

CLUSTER_ID = "5L6g3nShT-eMCtK--X86sw"

JVM_OPTIONS = ("KAFKA_HEAP_OPTS", "KAFKA_JVM_PERFORMANCE_OPTS")
"""The environment variables that set a broker's JVM options, read as Kafka's own start scripts
read them: the kit's brokers (containers and local processes) take them from the environment."""


@dataclass(frozen=True)
class BrokerAddress:
    """Where one KRaft node (broker and controller in one process) of a test cluster listens.

    Clients on the host reach it at 127.0.0.1:``port``. Other nodes reach its controller at
    ``host``:``controller_port`` and its broker at ``host``:``internal_port``, or at the client
    address when ``internal_port`` is None (local processes, which share the host's loopback).
    Containers on a network of their own need the internal listener: inside a container
    127.0.0.1 is the container itself, so the client address cannot serve other brokers.
    """

    node_id: int
    port: int
    controller_port: int
    host: str = "127.0.0.1"
    internal_port: int | None = None


def client_properties(path: str) -> dict[str, str]:
    """librdkafka settings from a properties file (``key=value`` lines, ``#`` comments), as
    Kafka's own tools take a client's security settings, so that a password stays in a file of
    its own rather than in a shared configuration or on a command line."""
    try:
        lines = open(path, encoding="utf-8").read().splitlines()
    except OSError as exc:
        raise ConfigError(f"kafka: cannot read the client settings file {path}: {exc.strerror}") from exc
    settings = {}
    for number, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, equals, value = line.partition("=")
        if not equals:
            raise ConfigError(f"kafka: {path} line {number}: expected key=value")
        settings[key.strip()] = value.strip()
    return settings


def broker_properties(node: BrokerAddress, cluster: Sequence[BrokerAddress] = (),
                      bind_host: str = "127.0.0.1") -> dict[str, str]:
    """Server properties of ``node``, one of ``cluster`` (default: a cluster of ``node`` alone).
    The one place broker settings are made: the container backend passes them as ``KAFKA_*``
    environment variables, the local backend writes them to a properties file.

    A single broker needs replication factor 1 and min ISR 1 for the transaction state log and
    the offsets topic, or transactions and group commits time out. Three brokers or more run as
    production does: every topic (the internal ones included) replicated three times, a write
    acknowledged by all needing two in-sync replicas, and no unclean leader election, so a
    replica that missed records never becomes leader.
    """
    cluster = tuple(cluster) or (node,)
    if 1 < len(cluster) < 3:
        raise ConfigError(f"kafka: a cluster of {len(cluster)} brokers; run 1, or 3 or more (replication factor 3)")
    replicas, min_isr = ("1", "1") if len(cluster) == 1 else ("3", "2")
    listeners = {"PLAINTEXT": (bind_host, node.port, "127.0.0.1"), "CONTROLLER": (bind_host, node.controller_port, None)}
    if node.internal_port is not None:
        listeners["INTERNAL"] = (bind_host, node.internal_port, node.host)
    return {
        "node.id": str(node.node_id),
        "process.roles": "broker,controller",
        "controller.quorum.voters": ",".join(f"{n.node_id}@{n.host}:{n.controller_port}" for n in cluster),
        "listeners": ",".join(f"{name}://{host}:{port}" for name, (host, port, _) in listeners.items()),
        "advertised.listeners": ",".join(f"{name}://{advertised}:{port}"
                                         for name, (_, port, advertised) in listeners.items() if advertised),
        "controller.listener.names": "CONTROLLER",
        "inter.broker.listener.name": "INTERNAL" if node.internal_port is not None else "PLAINTEXT",
        "listener.security.protocol.map": ",".join(f"{name}:PLAINTEXT" for name in listeners),
        "default.replication.factor": replicas,
        "min.insync.replicas": min_isr,
        "unclean.leader.election.enable": "false",
        "offsets.topic.replication.factor": replicas,
        "offsets.topic.num.partitions": "4",
        "transaction.state.log.replication.factor": replicas,
        "transaction.state.log.min.isr": min_isr,
        "transaction.state.log.num.partitions": "4",
        "group.initial.rebalance.delay.ms": "0",
        "auto.create.topics.enable": "false",
        "num.partitions": "2",
    }

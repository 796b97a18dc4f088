"""Kafka: client configuration, readiness and admin calls, and the broker's own settings.

The broker settings live here once and serve every backend: the container backend passes them
as ``KAFKA_*`` environment variables (the official apache/kafka image's convention), the
local-process backend writes them to a properties file.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic  # type: ignore[attr-defined]

from oncekit.core import clock
from oncekit.connectors.redact import redact_config
from oncekit.connectors.wait import wait_until
from oncekit.core.errors import AccessError, ConfigError, ServiceError

logger = logging.getLogger(__name__)

KAFKA_VERSION = "4.2.1"
"""The Kafka release oncekit tests against; docker/kafka/pom.xml pins the same."""

CLUSTER_ID = "5L6g3nShT-eMCtK--X86sw"


class _DemoteToDebug(logging.Filter):
    """Sends the librdkafka lines that ``demote`` picks to DEBUG, on the same logger."""

    def __init__(self, log: logging.Logger, demote: Callable[[str], bool]) -> None:
        super().__init__()
        self.log, self.demote = log, demote

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.DEBUG and self.demote(record.getMessage()):
            self.log.debug("%s", record.getMessage())
            return False
        return True


def client_log(name: str, demote: Callable[[str], bool] = lambda message: True) -> logging.Logger:
    """A logger for confluent-kafka clients (their ``logger`` setting), so that librdkafka's lines
    go through Python logging instead of stderr; the lines ``demote`` picks (default: all) go to
    DEBUG, for callers that report the failure themselves from the call's error."""
    log = logging.getLogger(name)
    if not any(isinstance(f, _DemoteToDebug) for f in log.filters):
        log.addFilter(_DemoteToDebug(log, demote))
    return log


ClientT = TypeVar("ClientT")
ProducerT = TypeVar("ProducerT")


class ClientPool:
    """The Kafka clients of this Python process, kept across tasks and batches: Spark reuses its
    Python workers, and a new client pays for its connections, metadata and (a transactional
    producer) ``init_transactions`` before its first call. A user takes a client for its
    exclusive use and gives it back when it succeeded; a client that failed is closed, never
    given back, so a broken connection or a fenced producer is not reused. Two users at once get
    two clients. Keys name what makes clients interchangeable (settings, transactional id)."""

    def __init__(self) -> None:
        self._idle: dict[tuple[Any, ...], Any] = {}
        self._lock = threading.Lock()

    def take(self, key: tuple[Any, ...], make: Callable[[], ClientT]) -> ClientT:
        with self._lock:
            found = self._idle.pop(key, None)
        return found if found is not None else make()

    def give(self, key: tuple[Any, ...], client: Any) -> None:
        with self._lock:
            if key not in self._idle:
                self._idle[key] = client
                return
        _close(client)  # another user gave one back first; one idle client per key is enough

    def discard(self, key: tuple[Any, ...]) -> None:
        """Close the idle client of ``key``, if any: its user knows it cannot work any more."""
        with self._lock:
            found = self._idle.pop(key, None)
        if found is not None:
            _close(found)

    @contextmanager
    def borrowed(self, key: tuple[Any, ...], make: Callable[[], ClientT]) -> Iterator[ClientT]:
        """A client of ``key`` for the ``with`` block: given back if the block ends normally,
        closed if it raises (a generator closed early counts as raising)."""
        client = self.take(key, make)
        try:
            yield client
        except BaseException:
            _close(client)
            raise
        self.give(key, client)


def _close(client: Any) -> None:
    if isinstance(client, Consumer):
        client.close()  # a producer is destroyed when dropped (it holds nothing once flushed or failed)


CLIENTS = ClientPool()
"""The process's pool; the source's readers and planner and the Kafka sinks take from it."""


class Clients(Protocol):
    """What makes a cluster's clients: confluent-kafka's, or a model's (the simulation)."""

    def producer(self, settings: dict[str, Any]) -> Any: ...

    def consumer(self, settings: dict[str, Any]) -> Any: ...

    def admin(self, settings: dict[str, Any]) -> Any: ...


class ConfluentClients:
    """confluent-kafka's clients: every cluster's, unless registered otherwise."""

    def producer(self, settings: dict[str, Any]) -> Producer:
        return Producer(settings)

    def consumer(self, settings: dict[str, Any]) -> Consumer:
        return Consumer(settings)

    def admin(self, settings: dict[str, Any]) -> AdminClient:
        return AdminClient(settings)


_CLIENTS_OF: dict[str, Clients] = {}


def register_clients(prefix: str, clients: Clients) -> None:
    """Clusters whose bootstrap servers start with ``prefix`` get their clients from ``clients``
    (the simulation's model of Kafka)."""
    _CLIENTS_OF[prefix] = clients


def clients_for(settings: Mapping[str, Any]) -> Clients:
    """The client maker of the cluster that ``settings`` (a client's, with its bootstrap
    servers) reach."""
    servers = str(settings.get("bootstrap.servers", ""))
    for prefix, clients in _CLIENTS_OF.items():
        if servers.startswith(prefix):
            return clients
    return _CONFLUENT


_CONFLUENT = ConfluentClients()


def new_producer(settings: dict[str, Any]) -> Any:
    return clients_for(settings).producer(settings)


def new_consumer(settings: dict[str, Any]) -> Any:
    return clients_for(settings).consumer(settings)


def new_admin(settings: dict[str, Any]) -> Any:
    return clients_for(settings).admin(settings)

# What a cluster answers while a broker restarts or a partition's leader moves: asking again
# (after librdkafka refreshed its metadata) is the cure, not failing the task or the query. A
# new client asked about a partition before its metadata holds it answers _UNKNOWN_PARTITION
# (the soak's planner, on the consumer it made right after a broker restart).
RETRIABLE = frozenset({KafkaError._TRANSPORT, KafkaError._TIMED_OUT, KafkaError._ALL_BROKERS_DOWN,
                       KafkaError._UNKNOWN_PARTITION,
                       KafkaError.LEADER_NOT_AVAILABLE, KafkaError.NOT_LEADER_FOR_PARTITION,
                       KafkaError.FENCED_LEADER_EPOCH, KafkaError.UNKNOWN_LEADER_EPOCH,
                       KafkaError.OFFSET_NOT_AVAILABLE, KafkaError.NOT_COORDINATOR,
                       KafkaError.COORDINATOR_NOT_AVAILABLE, KafkaError.COORDINATOR_LOAD_IN_PROGRESS})

ATTEMPT_S = 5.0
"""The timeout of one metadata or offsets request (list_topics, get_watermark_offsets, a marker
read's poll) on a pooled client. A client that lived through a broker restart can hold such a
request until its timeout although the broker is back (a 30 s list_topics in the source's
planner failed the query 30 s after every 3 s broker stop of the soak; a marker read held the
write-ahead publish 90 s). Callers ask with a short timeout and let the pool close the client
that failed (:meth:`ClientPool.borrowed`), so the next attempt connects afresh; each attempt
waits twice as long as the one before (:func:`attempt_timeout`)."""


def produce_when_room(producer: Any, *args: Any, **kwargs: Any) -> None:
    """``producer.produce(*args, **kwargs)``, waiting while librdkafka's local queue is full:
    each wait serves delivery reports for 50 ms. The queue drains by deliveries or, with the
    broker away, by their timeout (``delivery.timeout.ms``), so the wait ends. Every producer of
    the kit sends through this when a send can meet a full queue."""
    while True:
        try:
            producer.produce(*args, **kwargs)
            return
        except BufferError:
            producer.poll(0.05)


def connect_producer(producer: ProducerT, topic: str, timeout_s: float = 10.0) -> ProducerT:
    """Open ``producer``'s connection to a broker before its first ProducerId request
    (``init_transactions``, an idempotent producer's first send), and return it. Called by the
    Kafka sinks for every producer they make (with ``reconnect_backoff_ms`` 10 in its settings).

    That request needs a broker connection that is up. librdkafka drops the bootstrap connection
    once metadata names the brokers, opens the next one only after its reconnect back-off (100 ms
    by default), and if it finds none up retries the request after 500 ms: 60 ms or 510 ms per
    new producer, measured. Two metadata calls on ``topic`` (the first answered on the bootstrap
    connection, the second opening a broker's own) and a 10 ms back-off leave the request no
    wait: an idempotent producer's first acknowledged send took 60 ms this way against
    510-530 ms without."""
    try:
        for _ in range(2):
            producer.list_topics(topic, timeout=timeout_s)  # type: ignore[attr-defined]
    except KafkaException:
        pass  # a broker out of reach is reported by the call that needs it, under that call's timeout
    return producer


def attempt_timeout(attempt: int, deadline: float | None = None) -> float:
    """The timeout of try number ``attempt`` (from 0) of a request asked again on new clients:
    :data:`ATTEMPT_S`, doubled at each try, so that a new client on a loaded machine, which can
    need longer than the first try allows, still gets its answer; never past ``deadline``."""
    timeout: float = ATTEMPT_S * 2.0 ** min(attempt, 6)
    return timeout if deadline is None else min(timeout, max(0.1, deadline - clock.monotonic()))

T = TypeVar("T")


def retrying(what: str, call: Callable[[], T], timeout_s: float = 30.0) -> T:
    """``call()``, asked again every half second while it fails with what a restarting broker or
    a moving leader answers (:data:`RETRIABLE`, or an error librdkafka marks retriable), for up to
    ``timeout_s``; then its last error is raised, its text naming ``what`` (which also names the
    call in the log) and how long it was asked. A ``call`` that borrows its client from
    :data:`CLIENTS` gets a new one for the next attempt."""
    deadline = clock.monotonic() + timeout_s
    while True:
        try:
            return call()
        except KafkaException as exc:
            error = exc.args[0]
            if not (error.code() in RETRIABLE or error.retriable()):
                raise
            if clock.monotonic() >= deadline:
                raise KafkaException(KafkaError(error.code(), f"{what}: {error.str()}, still after {timeout_s:.0f} s",
                                                retriable=True)) from exc
            logger.info("%s: asking again after %s", what, error.str())
            clock.sleep(0.5)

READ_AHEAD: Mapping[str, Any] = {
    # librdkafka stops fetching a partition once queued.min.messages (100,000) wait in the local
    # queue, and looks again only after fetch.queue.backoff.ms (1 s by default): a reader that
    # drains the queue faster sits out the rest of that second. On 500,000 records of 100 bytes
    # this setting took a one-partition read from 1.4 s to 0.43 s.
    "fetch.queue.backoff.ms": 10,
    # A fetch at the log's end waits on the broker this long at most; the broker answers one
    # request per connection at a time, so the client's next request (a watermark query, a new
    # assignment's first fetch) waits behind it (500 ms by default).
    "fetch.wait.max.ms": 100,
}
"""Fetch settings for consumers that read records in bulk; see :meth:`KafkaConfig.consumer_settings`."""

RECONNECT: Mapping[str, Any] = {
    # librdkafka backs off between reconnects to a broker up to 10 s by default: a client that
    # lived through a broker restart found it back up to 10 s late, and a batch that read or
    # wrote through it waited that long (probe: 18-25 s from the broker's return to the next
    # committed batch). 1 s bounds the wait; it costs a connection attempt a second while a
    # broker is down.
    "reconnect.backoff.max.ms": 1000,
    # A connection attempt made while the broker is away can hang instead of being refused (a
    # port forwarder or proxy in front of it accepts; a host that is down never answers), and
    # librdkafka gives it up after 30 s by default: a client that lived through a 3 s broker
    # stop answered list_topics 19-20 s after the broker was back (2 of 2 here), one with 5 s
    # at once. 10 s, the Java client's default, leaves a slow TLS or SASL handshake its time.
    "socket.connection.setup.timeout.ms": 10_000,
}
"""Settings of every kit client, under the user's own (:meth:`KafkaConfig.settings`)."""

_PROBE_LOG = client_log(__name__ + ".probe")  # a broker still starting refuses connections: expected


@dataclass(frozen=True)
class KafkaConfig:
    """Where a Kafka cluster is and how to talk to it.

    ``client`` holds any librdkafka setting (security protocol, SASL, SSL); secret values never
    appear in ``repr`` or in error text.
    """

    bootstrap_servers: str
    client: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.bootstrap_servers.strip():
            raise ConfigError("kafka: bootstrap_servers is empty; give host:port[,host:port]")
        if "bootstrap.servers" in self.client:
            raise ConfigError("kafka: give bootstrap servers once, as bootstrap_servers, not in client settings")

    def __repr__(self) -> str:
        return f"KafkaConfig(bootstrap_servers={self.bootstrap_servers!r}, client={redact_config(self.client)!r})"

    def settings(self, **extra: Any) -> dict[str, Any]:
        """Settings for a confluent-kafka client: :data:`RECONNECT`, the shared ones, then
        ``extra`` (dots as in librdkafka, given here with underscores, e.g. ``transactional_id``)."""
        out: dict[str, Any] = {**RECONNECT, "bootstrap.servers": self.bootstrap_servers, **self.client}
        out.update({key.replace("_", "."): value for key, value in extra.items()})
        return out

    def consumer_settings(self, **extra: Any) -> dict[str, Any]:
        """Settings for a consumer that reads records in bulk (the source's readers, output
        checks): :data:`READ_AHEAD` under :meth:`settings`, so a user's own fetch settings win."""
        return {**READ_AHEAD, **self.settings(**extra)}


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


# librdkafka's codes for what no retry cures: credentials refused, a certificate not trusted.
_ACCESS_CODES = frozenset({KafkaError._AUTHENTICATION, KafkaError._SSL, KafkaError.SASL_AUTHENTICATION_FAILED,
                           KafkaError.TOPIC_AUTHORIZATION_FAILED, KafkaError.CLUSTER_AUTHORIZATION_FAILED})


def _probe(config: KafkaConfig) -> tuple[AdminClient, list[KafkaError]]:
    """An admin client whose errors (reported to ``error_cb``) land in the list returned with it."""
    seen: list[KafkaError] = []
    settings: dict[str, Any] = {**config.settings(logger=_PROBE_LOG), "error_cb": seen.append}
    return new_admin(settings), seen


def _access_error(bootstrap_servers: str, admin: AdminClient, seen: list[KafkaError]) -> AccessError | None:
    """The credentials or certificate error ``admin`` met so far, if any. librdkafka reports
    those only to ``error_cb`` (a call that fails says "transport failure"), which runs in
    ``poll``. Its text names the broker and the failure, never the password."""
    admin.poll(0.2)
    for error in seen:
        if error.code() in _ACCESS_CODES:
            return AccessError(f"kafka at {bootstrap_servers}: {error.str()}")
    return None


def _metadata(bootstrap_servers: str, admin: AdminClient, seen: list[KafkaError], timeout_s: float) -> Any:
    """``admin.list_topics`` within ``timeout_s``, asked a second at a time so that refused
    credentials or an untrusted certificate raise AccessError within about a second."""
    deadline = clock.monotonic() + timeout_s
    while True:
        try:
            return admin.list_topics(timeout=min(1.0, max(0.1, deadline - clock.monotonic())))
        except KafkaException:
            found = _access_error(bootstrap_servers, admin, seen)
            if found is not None:
                raise found from None
            if clock.monotonic() >= deadline:
                raise


def check_access(config: KafkaConfig, timeout_s: float = 10.0) -> None:
    """Raise AccessError if the cluster refuses ``config``'s credentials or serves a certificate
    it does not trust; any other failure (a broker down) is left to the caller's own calls.
    Called by the Kafka sinks' preflight and by the source when a call fails, so that a wrong
    password says so within seconds instead of as a timeout."""
    admin, seen = _probe(config)
    try:
        _metadata(config.bootstrap_servers, admin, seen, timeout_s)
    except KafkaException:
        pass  # not an access failure: the caller's own calls say what it is


def check_broker(bootstrap_servers: str, client: Mapping[str, Any] | None = None, brokers: int = 1) -> None:
    """Raise unless the cluster's metadata lists ``brokers`` brokers (or more) and a
    transactional producer can initialise; AccessError when it refuses the credentials or the
    certificate.

    Metadata alone is not enough: the transaction coordinator loads its log after the broker
    starts, and until then every transactional producer fails.
    """
    config = KafkaConfig(bootstrap_servers, dict(client or {}))
    admin, seen = _probe(config)
    try:
        metadata = _metadata(bootstrap_servers, admin, seen, 5.0)
        if len(metadata.brokers) < brokers:
            raise ServiceError(f"kafka at {bootstrap_servers}: {len(metadata.brokers)} of {brokers} brokers in the metadata")
        producer = Producer(config.settings(transactional_id=f"oncekit-probe-{uuid.uuid4()}", logger=_PROBE_LOG))
        producer.init_transactions(10)
    except KafkaException as exc:
        raise _access_error(bootstrap_servers, admin, seen) or ServiceError(
            f"kafka at {bootstrap_servers}: {exc.args[0]}") from exc


def create_topic(config: KafkaConfig, topic: str, partitions: int = 1, replication_factor: int = -1,
                 timeout_s: float = 30.0) -> None:
    """Create ``topic``; an existing topic with the same name is left as it is. The replication
    factor defaults to the cluster's own (``default.replication.factor``): 1 on a single test
    broker, 3 on a three-broker one, whatever the user's cluster is set to. Returns once the
    topic is in the metadata with a leader for every partition."""
    admin = new_admin(config.settings())  # must outlive the future, or librdkafka cancels it
    future = admin.create_topics(
        [NewTopic(topic, num_partitions=partitions, replication_factor=replication_factor)], operation_timeout=30
    )[topic]
    try:
        future.result(timeout=60)
    except KafkaException as exc:
        if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
            raise ServiceError(f"kafka: cannot create topic {topic!r}: {exc.args[0].str()}") from exc
    # The controller answers once the topic is created; each broker learns of it from the
    # metadata log a little later (a three-broker cluster in CI listed none of it right after).
    wait_until(lambda: _require_leaders(admin, topic), timeout_s, f"kafka topic {topic!r}")
    logger.info("kafka: topic %s ready with %s partitions", topic, partitions)


def _require_leaders(admin: AdminClient, topic: str) -> None:
    """Raise unless the metadata names ``topic`` and a leader for each of its partitions."""
    described = admin.list_topics(topic, timeout=10).topics.get(topic)
    if described is None or described.error is not None or not described.partitions:
        raise ServiceError(f"not in the metadata yet ({described.error if described else 'absent'})")
    leaderless = sorted(p for p, meta in described.partitions.items() if meta.leader < 0)
    if leaderless:
        raise ServiceError(f"partitions {leaderless} have no leader yet")


def broker_settings(config: KafkaConfig) -> dict[str, str]:
    """The settings of the cluster's lowest-id broker (DescribeConfigs), e.g.
    ``transaction.max.timeout.ms``. Called by the Kafka sinks' preflight and ``oncekit doctor``."""
    admin = new_admin(config.settings())  # must outlive the future, or librdkafka cancels it
    broker = min(admin.list_topics(timeout=30).brokers)
    resource = ConfigResource(ConfigResource.Type.BROKER, str(broker))
    described = admin.describe_configs([resource])[resource].result(timeout=30)
    return {name: entry.value for name, entry in described.items()}


def end_offsets(config: KafkaConfig, topic: str) -> dict[int, int]:
    """Per partition of ``topic``, its high watermark (the offset after its last record)."""
    consumer = Consumer(config.settings(group_id="oncekit-end-offsets"))
    try:
        partitions = consumer.list_topics(topic, timeout=30).topics[topic].partitions
        return {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30)[1] for p in sorted(partitions)}
    finally:
        consumer.close()


def partition_leader(config: KafkaConfig, topic: str, partition: int) -> int:
    """The node id of the broker that leads ``topic``'s ``partition`` now (-1 while it has none)."""
    metadata = AdminClient(config.settings()).list_topics(topic, timeout=30)
    try:
        return int(metadata.topics[topic].partitions[partition].leader)
    except KeyError as exc:
        raise ServiceError(f"kafka: no partition {partition} of topic {topic!r} in the metadata") from exc


def under_replicated(config: KafkaConfig) -> list[str]:
    """``topic[partition]`` of every partition, internal topics included, whose in-sync replicas
    are fewer than its replicas: a rolling restart waits for none before it stops the next broker."""
    metadata = AdminClient(config.settings()).list_topics(timeout=30)
    return [f"{name}[{p.id}]" for name, topic in sorted(metadata.topics.items())
            for p in topic.partitions.values() if len(p.isrs) < len(p.replicas)]

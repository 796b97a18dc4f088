"""Kafka clients: their configuration (:class:`KafkaConfig`), the process's pool of them, who makes
them (confluent-kafka, or a model of Kafka registered for its bootstrap servers: the simulation
of overlapping drivers), and the small helpers every kit client shares. Admin calls and checks
are :mod:`oncekit.connectors.kafka_admin`'s; a test broker's own settings
:mod:`oncekit.connectors.kafka_broker`'s.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer
from confluent_kafka.admin import AdminClient

from oncekit.core import clock
from oncekit.connectors.redact import redact_config
from oncekit.core.errors import ConfigError

logger = logging.getLogger(__name__)

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



_PEM_TRUST = "librdkafka reads CA certificates as PEM: ssl.ca.location (export a JKS truststore's with keytool -exportcert -rfc)"
_KEYSTORE = ("librdkafka reads a PKCS#12 keystore (ssl.keystore.location, ssl.keystore.password) or PEM files "
             "(ssl.certificate.location, ssl.key.location); convert a JKS keystore with keytool -importkeystore "
             "-deststoretype PKCS12")
_SERDE = "the kit's clients read and write bytes; turn the value into a string or binary column in the query"
JAVA_ONLY_SETTINGS = {
    "sasl.jaas.config": "librdkafka takes the credentials as sasl.username and sasl.password (mechanisms PLAIN and "
                        "SCRAM-*), or the sasl.oauthbearer.* settings (OAUTHBEARER), beside sasl.mechanism",
    "sasl.login.callback.handler.class": "librdkafka has no Java callbacks; for OAuth give sasl.oauthbearer.method=oidc "
                                         "and the sasl.oauthbearer.* settings",
    "ssl.truststore.location": _PEM_TRUST, "ssl.truststore.password": _PEM_TRUST, "ssl.truststore.type": _PEM_TRUST,
    "ssl.keystore.type": _KEYSTORE,
    "key.serializer": _SERDE, "value.serializer": _SERDE, "key.deserializer": _SERDE, "value.deserializer": _SERDE,
}
"""Settings of Kafka's Java client that librdkafka (the kit's client) does not have, with what it
takes instead: Spark's own Kafka options carry them, and a job moved to the kit may still."""


def refuse_java_client_settings(client: Mapping[str, Any], where: str, prefix: str = "") -> None:
    """Called where a sink or source takes its client settings: ConfigError naming each Java-client
    setting in ``client`` (as the user spelled it, with ``prefix``) and librdkafka's equivalent.
    Only names go in the message, never values (a JAAS line holds a password)."""
    found = sorted(key for key in client if key in JAVA_ONLY_SETTINGS)
    if found:
        raise ConfigError(f"{where}: " + "; ".join(f"{prefix}{key} is a setting of Kafka's Java client, which the kit "
                                                   f"does not use: {JAVA_ONLY_SETTINGS[key]}" for key in found))


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
        refuse_java_client_settings(self.client, "kafka")

    def __repr__(self) -> str:
        return f"KafkaConfig(bootstrap_servers={self.bootstrap_servers!r}, client={redact_config(self.client)!r})"

    def settings(self, **extra: Any) -> dict[str, Any]:
        """Settings for a confluent-kafka client: :data:`RECONNECT`, the shared ones, then
        ``extra`` (dots as in librdkafka, given here with underscores, e.g. ``transactional_id``)."""
        out: dict[str, Any] = {**RECONNECT, "bootstrap.servers": self.bootstrap_servers, **self.client}
        out.update({key.replace("_", "."): value for key, value in extra.items()})
        return out

    @functools.cached_property
    def pool_key(self) -> tuple[tuple[str, str], ...]:
        """What makes this cluster's clients interchangeable in :data:`CLIENTS` (a sink adds the
        transactional id, or what the client is for): its :meth:`settings`, made once per config
        (a sink is built at every task and driver commit)."""
        return tuple(sorted((str(key), str(value)) for key, value in self.settings().items()))

    def consumer_settings(self, **extra: Any) -> dict[str, Any]:
        """Settings for a consumer that reads records in bulk (the source's readers, output
        checks): :data:`READ_AHEAD` under :meth:`settings`, so a user's own fetch settings win."""
        return {**READ_AHEAD, **self.settings(**extra)}


def security_settings(options: Mapping[str, Any], prefix: str = "kafka.") -> dict[str, Any]:
    """The settings among ``options`` (named with ``prefix``, as Spark's Kafka options are) that
    say how to reach and log in to a cluster (``security.*``, ``sasl.*``, ``ssl.*``), unprefixed."""
    wanted = tuple(f"{prefix}{group}." for group in ("security", "sasl", "ssl"))
    return {key[len(prefix):]: value for key, value in options.items() if key.startswith(wanted)}


_clusters_read: dict[str, KafkaConfig] = {}


def remember_cluster_read(config: KafkaConfig) -> None:
    """Called by :func:`~oncekit.sources.kafka.kafka_stream` (on the driver, or the Spark Connect
    client): this process reads from ``config``'s cluster."""
    _clusters_read[config.bootstrap_servers] = config


def clusters_read() -> list[KafkaConfig]:
    """The Kafka clusters this process's kafka_stream calls read from, first first: the status
    page of ``oncekit run --ui`` asks the first for the input's end offsets."""
    return list(_clusters_read.values())

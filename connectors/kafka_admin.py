"""Kafka admin calls and checks of the kit: access (credentials, certificates), readiness,
topics, broker settings, offsets and leaders."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping
from typing import Any

from confluent_kafka import KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import ConfigResource, NewTopic  # type: ignore[attr-defined]

from oncekit.connectors.kafka import KafkaConfig, client_log, new_admin, new_consumer, new_producer
from oncekit.connectors.wait import wait_until
from oncekit.core import clock
from oncekit.core.errors import AccessError, ServiceError

logger = logging.getLogger(__name__)

_PROBE_LOG = client_log(__name__ + ".probe")  # a broker still starting refuses connections: expected


# librdkafka's codes for what no retry cures: credentials refused, a certificate not trusted.
_ACCESS_CODES = frozenset({KafkaError._AUTHENTICATION, KafkaError._SSL, KafkaError.SASL_AUTHENTICATION_FAILED,
                           KafkaError.TOPIC_AUTHORIZATION_FAILED, KafkaError.CLUSTER_AUTHORIZATION_FAILED})


def _probe(config: KafkaConfig) -> tuple[Any, list[KafkaError]]:
    """An admin client whose errors (reported to ``error_cb``) land in the list returned with it."""
    seen: list[KafkaError] = []
    settings: dict[str, Any] = {**config.settings(logger=_PROBE_LOG), "error_cb": seen.append}
    return new_admin(settings), seen


def _access_error(bootstrap_servers: str, admin: Any, seen: list[KafkaError]) -> AccessError | None:
    """The credentials or certificate error ``admin`` met so far, if any. librdkafka reports
    those only to ``error_cb`` (a call that fails says "transport failure"), which runs in
    ``poll``. Its text names the broker and the failure, never the password."""
    admin.poll(0.2)
    for error in seen:
        if error.code() in _ACCESS_CODES:
            return AccessError(f"kafka at {bootstrap_servers}: {error.str()}")
    return None


def _metadata(bootstrap_servers: str, admin: Any, seen: list[KafkaError], timeout_s: float) -> Any:
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


def check_access(config: KafkaConfig, timeout_s: float = 10.0) -> Any | None:
    """Raise AccessError if the cluster refuses ``config``'s credentials or serves a certificate
    it does not trust; any other failure (a broker down) is left to the caller's own calls.
    Called by the Kafka sinks' preflight and by the source when a call fails, so that a wrong
    password says so within seconds instead of as a timeout. Returns the cluster's metadata
    (``list_topics``: its brokers, and every topic with its partitions' leaders), which the
    preflight's next checks read instead of asking again; None when another failure kept it."""
    admin, seen = _probe(config)
    try:
        return _metadata(config.bootstrap_servers, admin, seen, timeout_s)
    except KafkaException:
        return None  # not an access failure: the caller's own calls say what it is


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
        producer = new_producer(config.settings(transactional_id=f"oncekit-probe-{uuid.uuid4()}", logger=_PROBE_LOG))
        producer.init_transactions(10)
    except KafkaException as exc:
        raise _access_error(bootstrap_servers, admin, seen) or ServiceError(
            f"kafka at {bootstrap_servers}: {exc.args[0]}") from exc


def create_topic(config: KafkaConfig, topic: str, partitions: int = 1, replication_factor: int = -1,
                 timeout_s: float = 30.0, metadata: Any = None) -> None:
    """Create ``topic``; an existing topic with the same name is left as it is. The replication
    factor defaults to the cluster's own (``default.replication.factor``): 1 on a single test
    broker, 3 on a three-broker one, whatever the user's cluster is set to. Returns once the
    topic is in the metadata with a leader for every partition: at once, without a request,
    when ``metadata`` (the cluster's, as :func:`check_access` returned it) shows it so."""
    if metadata is not None and _unready(metadata.topics.get(topic)) is None:
        return
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


def _require_leaders(admin: Any, topic: str) -> None:
    """Raise unless the metadata names ``topic`` and a leader for each of its partitions."""
    why = _unready(admin.list_topics(topic, timeout=10).topics.get(topic))
    if why is not None:
        raise ServiceError(why)


def _unready(described: Any) -> str | None:
    """Why a topic's metadata (None: the topic is not in it) does not show it ready for writes;
    None when it names a leader for each of its partitions."""
    if described is None or described.error is not None or not described.partitions:
        return f"not in the metadata yet ({described.error if described else 'absent'})"
    leaderless = sorted(p for p, meta in described.partitions.items() if meta.leader < 0)
    return f"partitions {leaderless} have no leader yet" if leaderless else None


def broker_settings(config: KafkaConfig, metadata: Any = None) -> dict[str, str]:
    """The settings of the cluster's lowest-id broker (DescribeConfigs), e.g.
    ``transaction.max.timeout.ms``; its id from ``metadata`` (the cluster's, as
    :func:`check_access` returned it) when given. Called by the Kafka sinks' preflight and
    ``oncekit doctor``."""
    admin = new_admin(config.settings())  # must outlive the future, or librdkafka cancels it
    broker = min((metadata or admin.list_topics(timeout=30)).brokers)
    resource = ConfigResource(ConfigResource.Type.BROKER, str(broker))
    described = admin.describe_configs([resource])[resource].result(timeout=30)
    return {name: entry.value for name, entry in described.items()}


def end_offsets(config: KafkaConfig, topic: str) -> dict[int, int]:
    """Per partition of ``topic``, its high watermark (the offset after its last record)."""
    consumer = new_consumer(config.settings(group_id="oncekit-end-offsets"))
    try:
        partitions = consumer.list_topics(topic, timeout=30).topics[topic].partitions
        return {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30)[1] for p in sorted(partitions)}
    finally:
        consumer.close()


def partition_leader(config: KafkaConfig, topic: str, partition: int) -> int:
    """The node id of the broker that leads ``topic``'s ``partition`` now (-1 while it has none)."""
    metadata = new_admin(config.settings()).list_topics(topic, timeout=30)
    try:
        return int(metadata.topics[topic].partitions[partition].leader)
    except KeyError as exc:
        raise ServiceError(f"kafka: no partition {partition} of topic {topic!r} in the metadata") from exc


def under_replicated(config: KafkaConfig) -> list[str]:
    """``topic[partition]`` of every partition, internal topics included, whose in-sync replicas
    are fewer than its replicas: a rolling restart waits for none before it stops the next broker."""
    metadata = new_admin(config.settings()).list_topics(timeout=30)
    return [f"{name}[{p.id}]" for name, topic in sorted(metadata.topics.items())
            for p in topic.partitions.values() if len(p.isrs) < len(p.replicas)]

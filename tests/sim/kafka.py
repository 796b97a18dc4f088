"""Kafka in the simulation: a model of a cluster that the kit's Kafka sinks reach through
confluent-kafka's client calls, so the sinks' real code runs against it. The clients are
registered for bootstrap servers that start with :data:`SERVERS_PREFIX`
(:func:`oncekit.connectors.kafka.register_clients`). The contract test (tests/sim/test_model_contract.py)
runs the same calls on the real broker and on this model and checks they answer alike.

What it models: topics of partitions, each a log of records; a transaction coordinator per
transactional id, whose producer epoch ``init_transactions`` raises, fencing every earlier
producer of the id (its next transactional call fails fatally) and aborting the transaction it
left open; a transaction open longer than its timeout is aborted by the coordinator, which fences
its producer too; read_committed reads stop at the last stable offset (the first record of a
transaction still open) and skip aborted records; a producer without a transactional id writes
committed records at once. Every client call is a scheduling point. Replication, leaders and
network faults are not modelled.
"""

from __future__ import annotations

import zlib
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import KafkaError, KafkaException, TopicPartition

from tests.sim.scheduler import Label, Scheduler, prefixed

SERVERS_PREFIX = "sim-kafka:"
MAX_TIMEOUT_MS = 900_000


@dataclass(eq=False)
class Record:
    key: bytes | None
    value: bytes | None
    state: str  # "committed", "open", "aborted"


@dataclass(eq=False)
class Txn:
    transactional_id: str
    epoch: int
    started: float
    timeout_s: float
    records: list[Record] = field(default_factory=list)
    partitions: set[tuple[str, int]] = field(default_factory=set)


@dataclass
class Coordinator:
    epoch: int = 0
    open: Txn | None = None


class Cluster:
    """One Kafka cluster of the simulated deployment."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.topics: dict[str, list[list[Record]]] = {}
        self.configs: dict[str, dict[str, str]] = {}
        self.coordinators: dict[str, Coordinator] = {}

    def step(self, label: Label) -> None:
        self.scheduler.step(prefixed("kafka ", label))

    def coordinator(self, transactional_id: str) -> Coordinator:
        self.expire()
        return self.coordinators.setdefault(transactional_id, Coordinator())

    def expire(self) -> None:
        """The coordinators abort transactions open past their timeout, and fence their producers."""
        for found in self.coordinators.values():
            txn = found.open
            if txn is not None and self.scheduler.time - txn.started > txn.timeout_s:
                self.end(txn, committed=False)
                found.open = None
                found.epoch += 1

    def end(self, txn: Txn, committed: bool) -> None:
        for record in txn.records:
            record.state = "committed" if committed else "aborted"

    def stable(self, topic: str, partition: int) -> int:
        """The last stable offset: the first record of a transaction still open, else the end."""
        self.expire()
        log = self.topics[topic][partition]
        return next((offset for offset, record in enumerate(log) if record.state == "open"), len(log))

    def committed(self, topic: str) -> list[tuple[bytes | None, bytes | None]]:
        """What a read_committed consumer of the whole topic reads (below each partition's
        last stable offset)."""
        out = []
        for partition, log in enumerate(self.topics.get(topic, [])):
            stable = self.stable(topic, partition)
            out += [(r.key, r.value) for r in log[:stable] if r.state == "committed"]
        return out

    def open_transactions(self) -> list[str]:
        self.expire()
        return sorted(tid for tid, found in self.coordinators.items() if found.open is not None)


def _error(code: int, reason: str, fatal: bool = False, retriable: bool = False) -> KafkaException:
    return KafkaException(KafkaError(code, reason, fatal=fatal, retriable=retriable))


class Producer:
    """confluent_kafka.Producer as the kit calls it."""

    def __init__(self, cluster: Cluster, settings: dict[str, Any]) -> None:
        self.cluster = cluster
        self.transactional_id: str | None = settings.get("transactional.id")
        self.timeout_s = int(settings.get("transaction.timeout.ms", 60_000)) / 1000
        self.epoch = -1
        self.txn: Txn | None = None
        self.fatal: KafkaException | None = None
        self._round_robin = 0

    def _live(self, what: str) -> None:
        """Raise the fatal error of a producer that a newer one of its id fenced."""
        if self.fatal is not None:
            raise self.fatal
        if self.transactional_id is None:
            return
        if self.cluster.coordinator(self.transactional_id).epoch != self.epoch:
            self.fatal = _error(KafkaError._FENCED, f"{what}: producer fenced by a newer instance", fatal=True)
            raise self.fatal

    def init_transactions(self, timeout: float | None = None) -> None:
        assert self.transactional_id is not None
        self.cluster.step(lambda: f"init_transactions {self.transactional_id}")
        found = self.cluster.coordinator(self.transactional_id)
        if found.open is not None:
            self.cluster.end(found.open, committed=False)
            found.open = None
        found.epoch += 1
        self.epoch = found.epoch

    def begin_transaction(self) -> None:
        self._live("begin_transaction")
        assert self.transactional_id is not None
        self.txn = Txn(self.transactional_id, self.epoch, self.cluster.scheduler.time, self.timeout_s)

    def produce(self, topic: str, value: bytes | None = None, key: bytes | None = None, partition: int = -1,
                **kwargs: Any) -> None:
        """A record, a scheduling point when another process can tell it was sent: a write
        outside a transaction, or a transaction's first to its partition (AddPartitionsToTxn,
        after which a reader under read_committed stops before it). Later records of the
        transaction in that partition are seen by nobody until it ends, so a step before each
        would add interleavings that no process can tell apart."""
        topics = self.cluster.topics
        if partition < 0 and topic in topics:
            partition = zlib.crc32(key) % len(topics[topic]) if key is not None else self._round_robin % len(topics[topic])
            self._round_robin += 1
        if self.transactional_id is None or self.txn is None or (topic, partition) not in self.txn.partitions:
            self.cluster.step(lambda: f"produce {topic}")
        if topic not in topics:
            raise _error(KafkaError._UNKNOWN_TOPIC, f"unknown topic {topic}")
        if partition >= len(topics[topic]):
            raise _error(KafkaError._UNKNOWN_PARTITION, f"unknown partition {topic}[{partition}]")
        if self.transactional_id is None:
            self.cluster.topics[topic][partition].append(Record(key, value, "committed"))
            return
        self._live("produce")
        txn = self.txn
        if txn is None:
            raise _error(KafkaError._STATE, "produce outside a transaction")
        found = self.cluster.coordinator(self.transactional_id)
        if (topic, partition) not in txn.partitions:  # AddPartitionsToTxn: the coordinator learns of it
            txn.partitions.add((topic, partition))
            found.open = txn
        record = Record(key, value, "open")
        txn.records.append(record)
        self.cluster.topics[topic][partition].append(record)

    def commit_transaction(self, timeout: float | None = None) -> None:
        self.cluster.step(lambda: f"commit_transaction {self.transactional_id}")
        self._live("commit_transaction")
        assert self.transactional_id is not None and self.txn is not None
        self.cluster.end(self.txn, committed=True)
        self.cluster.coordinator(self.transactional_id).open = None
        self.txn = None

    def abort_transaction(self, timeout: float | None = None) -> None:
        self.cluster.step(lambda: f"abort_transaction {self.transactional_id}")
        self._live("abort_transaction")
        assert self.transactional_id is not None
        if self.txn is not None:
            self.cluster.end(self.txn, committed=False)
        self.cluster.coordinator(self.transactional_id).open = None
        self.txn = None

    def flush(self, timeout: float | None = None) -> int:
        return 0

    def poll(self, timeout: float | None = None) -> int:
        return 0

    def list_topics(self, topic: str | None = None, timeout: float = -1) -> Any:
        return _metadata(self.cluster, topic)


@dataclass
class _Message:
    _topic: str
    _partition: int
    _offset: int
    _key: bytes | None = None
    _value: bytes | None = None
    _error: KafkaError | None = None

    def topic(self) -> str:
        return self._topic

    def partition(self) -> int:
        return self._partition

    def offset(self) -> int:
        return self._offset

    def key(self) -> bytes | None:
        return self._key

    def value(self) -> bytes | None:
        return self._value

    def error(self) -> KafkaError | None:
        return self._error


class Consumer:
    """confluent_kafka.Consumer as the kit's marker reads call it (assign, poll to the end)."""

    def __init__(self, cluster: Cluster, settings: dict[str, Any]) -> None:
        self.cluster = cluster
        self.read_committed = settings.get("isolation.level", "read_committed") == "read_committed"
        self.position: tuple[str, int, int] | None = None
        self.fetched: deque[_Message] = deque()  # what the last fetch returned, not yet polled

    def get_watermark_offsets(self, partition: TopicPartition, timeout: float | None = None,
                              cached: bool = False) -> tuple[int, int]:
        if not cached:  # the cached ones are what the last fetch told the client: no broker is asked
            self.cluster.step(lambda: f"watermarks {partition.topic}[{partition.partition}]")
        return 0, len(self.cluster.topics[partition.topic][partition.partition])

    def assign(self, partitions: list[TopicPartition]) -> None:
        (found,) = partitions
        self.position = (found.topic, found.partition, max(0, found.offset))
        self.fetched.clear()

    def unassign(self) -> None:
        self.position = None
        self.fetched.clear()

    def poll(self, timeout: float | None = None) -> _Message | None:
        """The next fetched record; when none is left, one fetch (a step): every committed
        record from the position up to the stable offset (the whole end, read_uncommitted),
        then the end of the partition. librdkafka fetches ahead in the same way, and a poll
        of a record already fetched talks to no broker: nothing can come between the two."""
        assert self.position is not None
        if not self.fetched:
            topic, partition, offset = self.position
            self.cluster.step(lambda: f"fetch {topic}[{partition}] from {offset}")
            log = self.cluster.topics[topic][partition]
            end = self.cluster.stable(topic, partition) if self.read_committed else len(log)
            self.fetched.extend(_Message(topic, partition, at, log[at].key, log[at].value)
                                for at in range(offset, end) if log[at].state == "committed")
            self.fetched.append(_Message(topic, partition, end, _error=KafkaError(KafkaError._PARTITION_EOF)))
            self.position = (topic, partition, max(offset, end))
        return self.fetched.popleft()

    def close(self) -> None:
        self.position = None
        self.fetched.clear()

    def list_topics(self, topic: str | None = None, timeout: float = -1) -> Any:
        return _metadata(self.cluster, topic)


class _Future:
    def __init__(self, value: Any = None, error: KafkaException | None = None) -> None:
        self.value, self.error = value, error

    def result(self, timeout: float | None = None) -> Any:
        if self.error is not None:
            raise self.error
        return self.value


@dataclass
class _Entry:
    value: str


class AdminClient:
    """confluent_kafka.admin.AdminClient as the kit's preflight calls it."""

    def __init__(self, cluster: Cluster, settings: dict[str, Any]) -> None:
        self.cluster = cluster

    def poll(self, timeout: float | None = None) -> int:
        return 0

    def list_topics(self, topic: str | None = None, timeout: float = -1) -> Any:
        self.cluster.step("list_topics")
        return _metadata(self.cluster, topic)

    def create_topics(self, topics: list[Any], operation_timeout: float = 0, **kwargs: Any) -> dict[str, _Future]:
        self.cluster.step("create_topics")
        out = {}
        for new in topics:
            if new.topic in self.cluster.topics:
                out[new.topic] = _Future(error=_error(KafkaError.TOPIC_ALREADY_EXISTS, f"{new.topic} exists"))
                continue
            count = new.num_partitions if new.num_partitions > 0 else 1
            self.cluster.topics[new.topic] = [[] for _ in range(count)]
            self.cluster.configs[new.topic] = {"cleanup.policy": "delete", **dict(new.config or {})}
            out[new.topic] = _Future()
        return out

    def create_partitions(self, partitions: list[Any], **kwargs: Any) -> dict[str, _Future]:
        self.cluster.step("create_partitions")
        out = {}
        for new in partitions:
            logs = self.cluster.topics[new.topic]
            if new.new_total_count <= len(logs):
                out[new.topic] = _Future(error=_error(KafkaError.INVALID_PARTITIONS, "not more partitions"))
                continue
            logs += [[] for _ in range(new.new_total_count - len(logs))]
            out[new.topic] = _Future()
        return out

    def describe_configs(self, resources: list[Any], **kwargs: Any) -> dict[Any, _Future]:
        self.cluster.step("describe_configs")
        out = {}
        for resource in resources:
            if str(resource.restype).endswith("BROKER"):
                entries = {"transaction.max.timeout.ms": _Entry(str(MAX_TIMEOUT_MS))}
            else:
                entries = {name: _Entry(value) for name, value in self.cluster.configs.get(resource.name, {}).items()}
            out[resource] = _Future(entries)
        return out


@dataclass
class _PartitionMeta:
    id: int
    leader: int = 1
    replicas: list[int] = field(default_factory=lambda: [1])
    isrs: list[int] = field(default_factory=lambda: [1])


@dataclass
class _TopicMeta:
    partitions: dict[int, _PartitionMeta]
    error: Any = None


@dataclass
class _Metadata:
    topics: dict[str, _TopicMeta]
    brokers: dict[int, Any]


def _metadata(cluster: Cluster, topic: str | None) -> _Metadata:
    names = [topic] if topic is not None else list(cluster.topics)
    topics = {name: _TopicMeta({p: _PartitionMeta(p) for p in range(len(cluster.topics[name]))})
              for name in names if name in cluster.topics}
    return _Metadata(topics, {1: object()})


class Clients:
    """The client classes of the model's cluster (:func:`oncekit.connectors.kafka.register_clients`)."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster

    def producer(self, settings: dict[str, Any]) -> Producer:
        return Producer(self.cluster, settings)

    def consumer(self, settings: dict[str, Any]) -> Consumer:
        return Consumer(self.cluster, settings)

    def admin(self, settings: dict[str, Any]) -> AdminClient:
        return AdminClient(self.cluster, settings)

"""The Kafka sinks' batch markers and owner record, in a compacted topic of the kit's
(:class:`~oncekit.core.names.MarkerTopic`).

A batch marker says "writer W published batch B: R records, checksum C, in the query run of epoch
E". It is a record of the marker topic written inside the transaction that publishes the batch, so
it becomes visible exactly when the batch does. A replayed batch reads its writer's latest marker
first and writes nothing if the batch is there; a writer whose latest marker is a newer run's
writes nothing at all (FencedError).

The owner record (partition 0) holds the query that writes through the sink and the epoch of its
newest run: the sink's epoch register. It is written only by compare-and-set
(:meth:`MarkerLog.compare_and_set`): a producer of the sink's owner transactional id initialises
(fencing every earlier one and aborting what it left open), reads the record, and commits the new
one in a transaction, which fails if another producer of the id initialised meanwhile. So no two
runs take the same epoch, and an epoch is raised only above the one read.

Why a topic and not consumer-group offsets (``send_offsets_to_transaction``), which the sinks
used before:

- Kafka deletes the offsets of a group without members ``offsets.retention.minutes`` (7 days by
  default) after their last commit: a pipeline down longer than that lost its markers and wrote
  a half-committed batch again. A compacted topic keeps the last record of each key for ever.
- librdkafka's group-coordinator request ignores its timeout and waits on a coordinator it
  cached before a broker restart (confluentinc/librdkafka#5456, #5511): a producer that lived
  through a broker restart blocked in ``send_offsets_to_transaction`` for minutes, and the query
  with it. Writing a record needs only the transaction coordinator. When both issues are fixed
  upstream, this reason goes; the first stays.

Reading the latest marker of a writer: the last record below its partition's last stable offset
(read_committed), once that offset has reached the high watermark. Only the writer's own
transactional id writes the partition, so a record above the stable offset belongs to a
transaction of that id not yet decided, and the read must wait for it: a producer's
``commit_transaction`` returns once the transaction is decided, and the broker writes the commit
markers after that (seconds later after a broker restart), so a task retried on the same pooled
producer read its own committed batch as missing and wrote it twice. A read that does not
settle within :data:`SETTLE_S` raises UnsettledMarkerError: the caller starts over with a new
producer, whose ``init_transactions`` returns only once every earlier transaction of the id is
decided (and fences a newer zombie, aborting its open one).
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Callable
from typing import Any

from confluent_kafka import ConsumerGroupTopicPartitions, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, ConfigResource, NewPartitions, NewTopic  # type: ignore[attr-defined]

from oncekit.core import clock
from oncekit.connectors.kafka import CLIENTS, RETRIABLE, KafkaConfig, attempt_timeout, client_log, connect_producer, new_admin, new_consumer, new_producer, produce_when_room
from oncekit.connectors.wait import wait_until
from oncekit.core.deadline import bounded
from oncekit.core.errors import ConfigError, FencedError, ServiceError, UnsettledMarkerError
from oncekit.core.names import KafkaTransactionalId, MarkerTopic
from oncekit.sinks.kafka._batch_marker import BatchMarker
from oncekit.core.protocol import SinkOwner

logger = logging.getLogger(__name__)

READ_S = 30.0
"""How long a marker or owner read may take, retries of a moving partition leader included."""
SETTLE_S = 2.0
"""How long a read with a pooled producer waits for the marker partition to settle before the
caller starts over with a new producer."""
UNSETTLED_POLL_MAX_S = 0.5
"""The longest pause between two reads of a marker partition that holds an undecided
transaction (the pauses double from 0.05 s up to this)."""

TOPIC_CONFIG = {"cleanup.policy": "compact", "segment.bytes": str(16 * 1024 * 1024)}
"""The marker topic's settings: compacted, so the latest marker of each writer is kept for ever;
small segments, so the compaction that bounds its size runs soon."""

_MARKER_KEY, _OWNER_KEY = b"batch", b"owner"
_NO_MARKER = b"{}"
"""A writer's marker after a reset by a kit that recorded no epoch in it."""
CAS_ATTEMPTS = 8
"""How often a compare-and-set of the owner record starts over after another producer of the
owner id initialised meanwhile."""
_CLIENT_LOG = client_log(__name__ + ".librdkafka")

_partitions_seen: dict[str, int] = {}  # marker topic: partitions this process knows exist


class MarkerLog:
    """One sink's marker topic. Built by the Kafka sinks in whichever process needs it, with
    ``transactional``: a new, initialised transactional producer of an id (the sink's)."""

    def __init__(self, kafka: KafkaConfig, sink_id: str, client_key: tuple[Any, ...],
                 transactional: Callable[[KafkaTransactionalId], Any]) -> None:
        self.kafka, self.sink_id, self.topic = kafka, sink_id, str(MarkerTopic(sink_id))
        self._client_key = client_key
        self._transactional = transactional

    # -- driver: preflight and owner ------------------------------------------------------------

    def prepare(self, resumed: bool, metadata: Any = None) -> None:
        """Driver, in the sink's preflight: create the marker topic if it is missing, and refuse
        one whose records can expire. ``resumed``: this checkpoint has run the sink before, so
        its markers must exist; markers the kit kept as consumer-group offsets before are
        carried over, and none at all is an error that says how to get out. ``metadata``: the
        cluster's, when the preflight listed it already."""
        admin = new_admin(self.kafka.settings(logger=_CLIENT_LOG))
        if self.topic not in (metadata or admin.list_topics(timeout=30)).topics:
            self._create(admin)
            if resumed and not self._adopt_group_markers(admin):
                raise ConfigError(
                    f"kafka sink {self.sink_id}: this checkpoint has written through the sink before, but its marker "
                    f"topic {self.topic} did not exist (deleted?) and no older markers were found. Without them a "
                    "replayed batch cannot be told from a new one. Restore the topic, or start the sink over with a "
                    "new checkpoint and a new sink_id")
        resource = ConfigResource(ConfigResource.Type.TOPIC, self.topic)
        policy = admin.describe_configs([resource])[resource].result(timeout=30)["cleanup.policy"].value
        if "delete" in policy.split(",") or "compact" not in policy:
            raise ConfigError(
                f"kafka sink {self.sink_id}: marker topic {self.topic} has cleanup.policy={policy}; Kafka would delete "
                "markers a replay needs. Set it back: kafka-configs.sh --alter --entity-type topics --entity-name "
                f"{self.topic} --add-config cleanup.policy=compact")

    def _create(self, admin: AdminClient) -> None:
        future = admin.create_topics([NewTopic(self.topic, num_partitions=MarkerTopic.partition_of(0) + 1,
                                               config=TOPIC_CONFIG)], operation_timeout=30)[self.topic]
        try:
            future.result(timeout=60)
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise ServiceError(f"kafka sink {self.sink_id}: cannot create marker topic {self.topic}: "
                                   f"{exc.args[0].str()}") from exc
        wait_until(lambda: self._require_partitions(MarkerTopic.partition_of(0) + 1), 30.0, f"marker topic {self.topic}")

    def _adopt_group_markers(self, admin: AdminClient) -> bool:
        """Copy the markers and owner that the kit kept as committed offsets of consumer groups
        (``oncekit-<sink>``, ``oncekit-<sink>-<partition>``, ``oncekit-<sink>:owner``, on partition
        0 of the output topic; offset = batch + 1) into the marker topic. True if any was found."""
        prefix = f"oncekit-{self.sink_id}"
        listed = admin.list_consumer_groups(request_timeout=30).result()
        groups = [g.group_id for g in listed.valid if g.group_id == prefix or g.group_id.startswith(prefix + "-")
                  or g.group_id == prefix + ":owner"]
        records: list[tuple[int, bytes, bytes]] = []
        for group in groups:
            suffix = group[len(prefix):]
            if suffix not in ("", ":owner") and not suffix[1:].isdigit():
                continue  # another sink's group whose id starts like this one's
            found = admin.list_consumer_group_offsets([ConsumerGroupTopicPartitions(group)])[group].result(timeout=30)
            for committed in found.topic_partitions or []:
                if committed.partition != 0 or not committed.metadata:
                    continue
                if suffix == ":owner":
                    records.append((MarkerTopic.OWNER_PARTITION, _OWNER_KEY, committed.metadata.encode()))
                else:
                    old = json.loads(committed.metadata)
                    writer = int(suffix[1:]) if suffix else 0
                    marker = BatchMarker(committed.offset - 1, int(old["rows"]), str(old["checksum"]))
                    records.append((MarkerTopic.partition_of(writer), _MARKER_KEY, marker.to_bytes()))
        for partition, _, _ in records:
            self._require_partition_for(partition)
        self._write(records)
        if records:
            logger.warning("kafka sink %s: carried %s markers over from consumer groups %s into %s", self.sink_id,
                           len(records), groups, self.topic)
        return bool(records)

    def owner(self) -> SinkOwner | None:
        """Driver: the query recorded as writing through the sink, if any."""
        recorded = self._owner_record()
        if not recorded or not recorded.get("query_id"):
            return None
        return SinkOwner(str(recorded["query_id"]), str(recorded["checkpoint"]))

    def _owner_record(self) -> dict[str, Any] | None:
        where = f"kafka sink {self.sink_id}: owner read"
        value = bounded(f"{where} from {self.topic}", READ_S + 5, self._last, MarkerTopic.OWNER_PARTITION, where, READ_S)
        return None if value is None else dict(json.loads(value))

    def compare_and_set(self, update: Callable[[dict[str, Any]], dict[str, Any] | None]) -> dict[str, Any]:
        """Driver: the owner record as ``update`` makes it from the current one (``{}`` for none;
        None: keep it), written only if no other producer of the owner id initialised between
        this one's read and its commit (else it reads and tries again, :data:`CAS_ATTEMPTS` times).
        ``update`` may raise (FencedError) to write nothing. Returns the record that stands."""
        where = f"kafka sink {self.sink_id}: owner record"
        transactional_id = KafkaTransactionalId.owner(self.sink_id)
        last: Exception | None = None
        for _ in range(CAS_ATTEMPTS):
            producer = self._transactional(transactional_id)  # initialised: every earlier one is fenced
            try:
                current = self._owner_record() or {}
                wanted = update(dict(current))
                if wanted is None:
                    return current
                producer.begin_transaction()
                produce_when_room(producer, self.topic, json.dumps(wanted).encode(), _OWNER_KEY,
                                  partition=MarkerTopic.OWNER_PARTITION)
                bounded(f"{where}: commit_transaction", READ_S + 5, producer.commit_transaction, READ_S)
                return wanted
            except KafkaException as exc:
                if not exc.args[0].fatal():
                    raise ServiceError(f"{where}: cannot write it: {exc.args[0].str()}") from exc
                last = exc  # another producer of the id initialised meanwhile: read again
            finally:
                producer.flush(0)
        raise ServiceError(f"{where}: {CAS_ATTEMPTS} compare-and-set attempts were fenced by other writers: {last}")

    def take_epoch(self, floor: int) -> int:
        """Driver, at a run's start: raise the sink's epoch above its own and ``floor``; the new
        epoch, which no other run ever holds."""
        record = self.compare_and_set(lambda current: {"query_id": "", "checkpoint": "", **current,
                                                       "epoch": max(int(current.get("epoch", 0)), floor) + 1})
        return int(record["epoch"])

    def hold_epoch(self, epoch: int) -> None:
        """Driver, at the start of a run whose epoch another target gave: raise the sink's epoch
        to ``epoch``; FencedError if it holds a newer one."""
        def raise_to(current: dict[str, Any]) -> dict[str, Any] | None:
            held = int(current.get("epoch", 0))
            if held > epoch:
                raise FencedError(f"kafka sink {self.sink_id}: this run (epoch {epoch}) was superseded by epoch {held}: "
                                  "another driver took the query over")
            return None if held == epoch else {**current, "epoch": epoch}

        self.compare_and_set(raise_to)

    def record_owner(self, owner: SinkOwner, epoch: int) -> None:
        """Driver, from the sink's claim: record ``owner``; FencedError when a newer run than
        ``epoch`` holds the sink."""
        def claim(current: dict[str, Any]) -> dict[str, Any]:
            held = int(current.get("epoch", 0))
            if held > epoch:
                raise FencedError(f"kafka sink {self.sink_id}: recording query {owner.query_id} as the owner: this run "
                                  f"(epoch {epoch}) was superseded by epoch {held}")
            return {**current, "query_id": owner.query_id, "checkpoint": owner.checkpoint, "epoch": max(held, epoch)}

        self.compare_and_set(claim)

    def reset(self, writers: Callable[[int], KafkaTransactionalId], epoch: int) -> None:
        """Driver, from the sink's claim when another query takes the sink id over: every
        writer's latest marker becomes an empty one of ``epoch`` (:meth:`BatchMarker.empty`), so
        that the new query's batches, numbered from its own start, are never taken for the
        previous query's. Each is written in a transaction of the writer's own id (``writers``
        names it), whose initialisation fences the previous query's producer of that writer and
        aborts what it left open; a producer of the previous query made later reads the empty
        marker, newer than its run, and writes nothing."""
        count = self._count(new_admin(self.kafka.settings(logger=_CLIENT_LOG)))
        for partition in range(MarkerTopic.OWNER_PARTITION + 1, count):
            transactional_id = writers(partition - 1)
            producer = self._transactional(transactional_id)
            try:
                producer.begin_transaction()
                produce_when_room(producer, self.topic, BatchMarker.empty(epoch).to_bytes(), _MARKER_KEY,
                                  partition=partition)
                bounded(f"kafka sink {self.sink_id}: reset of {self.topic}[{partition}]: commit_transaction", READ_S + 5,
                        producer.commit_transaction, READ_S)
            except KafkaException as exc:
                raise ServiceError(f"kafka sink {self.sink_id}: cannot reset the markers of {transactional_id}: "
                                   f"{exc.args[0].str()}") from exc
            finally:
                producer.flush(0)
        logger.info("kafka sink %s: markers of %s writers reset in %s (epoch %s)", self.sink_id,
                    max(0, count - 1), self.topic, epoch)

    def _write(self, records: list[tuple[int, bytes, bytes]]) -> None:
        """Records (partition, key, value) outside any transaction, acknowledged by the cluster
        (the owner, markers carried over or reset)."""
        failures: list[str] = []

        def delivered(error: KafkaError | None, _: object) -> None:
            if error is not None:
                failures.append(error.str())

        producer = connect_producer(new_producer({**self.kafka.settings(enable_idempotence=True, reconnect_backoff_ms=10,
                                                                     logger=_CLIENT_LOG), "on_delivery": delivered}), self.topic)
        for partition, key, value in records:
            producer.produce(self.topic, value, key, partition=partition)
        remaining = bounded(f"kafka sink {self.sink_id}: write to {self.topic}", 65, producer.flush, 60)
        if remaining or failures:
            raise ServiceError(f"kafka sink {self.sink_id}: could not write to {self.topic}: "
                               f"{failures[0] if failures else 'timed out'}")

    # -- task or publisher: markers -------------------------------------------------------------

    def ensure_writer(self, writer: int) -> None:
        """Before ``writer``'s first marker: its partition exists (the topic grows as Spark's
        partitions do). Known partitions are remembered per process, so this costs nothing
        after the first time."""
        self._require_partition_for(MarkerTopic.partition_of(writer))

    def _require_partition_for(self, partition: int) -> None:
        if _partitions_seen.get(self.topic, 0) > partition:
            return
        admin = new_admin(self.kafka.settings(logger=_CLIENT_LOG))
        if self._count(admin) <= partition:
            future = admin.create_partitions([NewPartitions(self.topic, partition + 1)], operation_timeout=30)[self.topic]
            try:
                future.result(timeout=60)
            except KafkaException as exc:
                if exc.args[0].code() != KafkaError.INVALID_PARTITIONS:  # another task grew it first
                    raise ServiceError(f"kafka sink {self.sink_id}: cannot add partitions to {self.topic}: "
                                       f"{exc.args[0].str()}") from exc
        wait_until(lambda: self._require_partitions(partition + 1, admin), 30.0, f"marker topic {self.topic}")

    def _count(self, admin: AdminClient) -> int:
        described = admin.list_topics(self.topic, timeout=10).topics.get(self.topic)
        count = len(described.partitions) if described is not None and described.error is None else 0
        _partitions_seen[self.topic] = max(_partitions_seen.get(self.topic, 0), count)
        return count

    def _require_partitions(self, count: int, admin: AdminClient | None = None) -> None:
        found = self._count(admin or new_admin(self.kafka.settings(logger=_CLIENT_LOG)))
        if found < count:
            raise ServiceError(f"{found} of {count} partitions in the metadata")

    def produce(self, producer: Any, writer: int, marker: BatchMarker) -> None:
        """Inside the caller's open transaction: ``writer``'s marker (after :meth:`ensure_writer`),
        queued once the producer's queue has room. A producer that has not seen the partition yet
        (the topic grew since its last metadata) refreshes its metadata once."""
        partition = MarkerTopic.partition_of(writer)
        try:  # the task's records may have filled the producer's queue: wait for room
            produce_when_room(producer, self.topic, marker.to_bytes(), _MARKER_KEY, partition=partition)
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError._UNKNOWN_PARTITION:
                raise
            producer.list_topics(self.topic, timeout=10)
            produce_when_room(producer, self.topic, marker.to_bytes(), _MARKER_KEY, partition=partition)

    def latest(self, writer: int, where: str, settle_s: float = SETTLE_S) -> BatchMarker | None:
        """``writer``'s latest committed marker (an empty one after a reset), None if it has none
        (after :meth:`ensure_writer`). Waits up to ``settle_s`` for the partition to settle
        (UnsettledMarkerError after); ``where`` names sink, batch and partition in the errors."""
        partition = MarkerTopic.partition_of(writer)
        value = bounded(f"{where}: marker read from {self.topic}[{partition}]", READ_S + settle_s + 5, self._last,
                        partition, where, settle_s)
        if value is None:
            return None
        return BatchMarker.empty(0) if value == _NO_MARKER else BatchMarker.from_bytes(value)

    def _last(self, partition: int, where: str, settle_s: float) -> bytes | None:
        """The value of the last committed record of ``partition``, None if it has none, once
        no transaction is undecided there (see the module's docstring). Retries what a moving
        leader or a restarting broker answers until :data:`READ_S` passed."""
        start = clock.monotonic()
        deadline = start + READ_S
        attempts, unsettled = itertools.count(), itertools.count()
        while True:
            try:
                with CLIENTS.borrowed((*self._client_key, "markers"), self._consumer) as consumer:
                    value, settled = _last_record(consumer, TopicPartition(self.topic, partition),
                                                  attempt_timeout(next(attempts), deadline), deadline)
                if settled:
                    return value
                if clock.monotonic() - start > settle_s:
                    raise UnsettledMarkerError(
                        f"{where}: {self.topic}[{partition}] still holds an undecided transaction of this writer "
                        f"after {settle_s:.0f} s")
                # Soon after a fence the transaction is decided at once; one left open by a dead
                # producer waits for its timeout (a minute by default): ask less often meanwhile.
                clock.sleep(min(UNSETTLED_POLL_MAX_S, 0.05 * 2 ** min(next(unsettled), 4)))
            except KafkaException as exc:
                # An unknown partition (in RETRIABLE): the topic grew since this consumer's
                # metadata; the pool closed that consumer, and the next one asks afresh.
                again = exc.args[0].code() in RETRIABLE or exc.args[0].retriable()
                if not again or clock.monotonic() > deadline:
                    raise
                logger.info("kafka sink %s: marker read from %s[%s] again: %s", self.sink_id, self.topic, partition,
                            exc.args[0].str())
                clock.sleep(0.5)

    def _consumer(self) -> Any:
        # Assigned a partition at an offset of its own, it never joins its group or commits;
        # librdkafka wants a group id all the same. A short fetch wait: the read ends at the
        # stable offset, where a long poll would only hold the answer back.
        return new_consumer(self.kafka.settings(group_id=self.topic, enable_auto_commit=False, enable_partition_eof=True,
                                            isolation_level="read_committed", fetch_wait_max_ms=1,
                                            logger=_CLIENT_LOG))


def _last_record(consumer: Any, partition: TopicPartition, timeout_s: float,
                 deadline: float) -> tuple[bytes | None, bool]:
    """The value of the last record below ``partition``'s last stable offset, read from there
    backwards in windows of 8, 64, 512... records (None if the partition holds none), and whether
    the stable offset had reached the high watermark. The fetch responses tell both: the read
    ends at the stable offset (read_committed), and the cached watermark is the high one."""
    low, stable = consumer.get_watermark_offsets(partition, timeout=timeout_s, cached=False)
    window = 8
    while True:
        start = max(low, stable - window)
        consumer.assign([TopicPartition(partition.topic, partition.partition, start)])
        try:
            last, end = _read_to_end(consumer, timeout_s, deadline)
            high = consumer.get_watermark_offsets(partition, cached=True)[1]
        finally:
            consumer.unassign()  # no fetches in the background while the consumer sits in the pool
        if last is not None or start == low:
            return last, end >= high
        window *= 8


def _read_to_end(consumer: Any, timeout_s: float, deadline: float) -> tuple[bytes | None, int]:
    """The value of the last record up to the end of the assigned partition, and the end's offset."""
    last = None
    while True:
        message = consumer.poll(min(timeout_s, max(0.1, deadline - clock.monotonic())))
        if message is None:
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "no end of partition before the deadline"))
        error = message.error()
        if error is not None:
            if error.code() == KafkaError._PARTITION_EOF:
                return last, message.offset() or 0
            raise KafkaException(error)
        last = message.value()


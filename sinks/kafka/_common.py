"""What the Kafka sinks' protocols share: the records of a partition or batch as Arrow arrays with
their checksum, producers from the process's pool (:data:`~oncekit.connectors.kafka.CLIENTS`),
publishing in one transaction with the batch marker (:mod:`oncekit.sinks.kafka._markers`), and
the preflight.

Every transactional call runs under a deadline of the kit's (:func:`~oncekit.core.deadline.bounded`):
a call that does not return in time fails the task or the publish with a StallError naming
sink, batch, partition and step, and its producer is never used again.

No Python code runs per record: Arrow converts the columns to lists of bytes, ``map`` hands them
to librdkafka's ``produce`` and to ``zlib.crc32`` for the checksum, and delivery reports come
back for failed records only, to one callback set in the producer's configuration
(:class:`SinkProducer`). Records are produced part by part as Spark delivers them
(:class:`RecordStream`), so a task's input and its sending overlap.
"""

from __future__ import annotations

import collections
import itertools
import logging
import operator
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from confluent_kafka import KafkaError, KafkaException

from oncekit.core import clock
from oncekit.connectors.kafka import CLIENTS, client_log, connect_producer, new_producer, produce_when_room
from oncekit.connectors.kafka_admin import broker_settings, check_access, create_topic
from oncekit.core.crash import crash_point
from oncekit.core.deadline import bounded
from oncekit.core.errors import ConfigError, OncekitError, RecordError, StallError, UnsettledMarkerError
from oncekit.core.names import KafkaTransactionalId
from oncekit.core.protocol import SinkOwner
from oncekit.sinks.kafka._batch_marker import BatchMarker
from oncekit.sinks.kafka._markers import MarkerLog
from oncekit.sinks.kafka._records import Records, RecordStream, checksum

if TYPE_CHECKING:
    from oncekit.sinks.kafka.config import KafkaSinkConfig

logger = logging.getLogger(__name__)

FORMAT = "oncekit-kafka-sink"
DEFAULT_TRANSACTION_TIMEOUT_MS = 60_000  # the broker's transaction.max.timeout.ms must allow it

INIT_S = 30.0
"""``init_transactions``' timeout; the kit's deadline for it is 5 s longer."""
COMMIT_S = 90.0
"""How long a commit may take, retries of retriable errors included; then the task fails."""
ABORT_S = 30.0
"""``abort_transaction``'s timeout; the kit's deadline for it is 5 s longer."""
GRACE_S = 5.0
"""What the kit's deadline adds to a call's own timeout, which librdkafka should honour first."""

_PURGED = (KafkaError._PURGE_QUEUE, KafkaError._PURGE_INFLIGHT)

# librdkafka logs a producer fenced by a newer instance as fatal. For a pooled producer that is
# expected (another worker's producer of the same transactional id took over, and the task starts
# over with a fresh one), so those lines go to DEBUG; everything else stays.
_CLIENT_LOG = client_log(__name__ + ".librdkafka", demote=lambda message: "fenced" in message.lower())


def unwritten_columns(columns: Sequence[str]) -> list[str]:
    """The columns of Spark's Kafka sink among ``columns`` that the kit's Kafka sinks do not
    write (their topic is the sink's; partitions follow the key; headers are not sent)."""
    return [name for name in ("topic", "partition", "headers") if name in columns]


class SinkProducer:
    """A producer whose failed deliveries (the only ones reported: ``delivery.report.only.error``)
    are appended to :attr:`failures`; the caller clears it before a transaction or task and
    reads it after the commit or flush. The callback is set once in the configuration: one
    passed to every ``produce`` call makes librdkafka keep a state per record and doubled
    produce's cost (0.28 s against 0.56-0.76 s per 250,000 records of 100 bytes). The client's
    calls are its own bound methods here, so a produce costs what the client's does."""

    def __init__(self, settings: dict[str, Any]) -> None:
        self.failures: list[str] = []
        self.fresh = True
        """Not yet given back to the pool: a transactional one initialised for the current task."""
        client = new_producer({**settings, "on_delivery": self._failed})
        self.client = client
        self.produce: Callable[..., None] = client.produce
        self.poll: Callable[..., int] = client.poll
        self.flush: Callable[..., int] = client.flush
        self.list_topics: Callable[..., Any] = client.list_topics
        self.init_transactions: Callable[..., None] = client.init_transactions
        self.begin_transaction: Callable[[], None] = client.begin_transaction
        self.commit_transaction: Callable[..., None] = client.commit_transaction
        self.abort_transaction: Callable[..., None] = client.abort_transaction

    def _failed(self, error: Any, message: Any) -> None:  # librdkafka's delivery report
        if error.code() not in _PURGED:  # records of a transaction the sink aborted itself
            self.failures.append(f"a record for {message.topic()} [{message.partition()}]: {error.str()}")

    def topic_missing(self, topic: str) -> bool:
        """Whether the cluster says ``topic`` does not exist (False when it cannot tell within 5 s)."""
        try:
            found = self.list_topics(topic, timeout=5).topics.get(topic)
        except KafkaException:
            return False
        return found is None or (found.error is not None and found.error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART)


class KafkaSinkBase:
    """Producers, topics, markers and preflight shared by the three protocols. Built by
    ``KafkaSinkConfig.build`` in the driver's worker, a task, or the listener."""

    epoch: int = 0  # the query run's this object acts for (Sink.act_for)

    def __init__(self, config: KafkaSinkConfig) -> None:
        self.config, self.sink_id = config, config.sink_id
        self._client_key = config.kafka.pool_key
        self.markers = MarkerLog(config.kafka, config.sink_id, self._client_key,
                                 lambda transactional_id: self.take_producer(transactional_id, fresh=True))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config!r})"

    def preflight(self, resumed: bool = False) -> None:
        """Driver, at query start: the topic exists (or is created), the marker topic too
        (:meth:`MarkerLog.prepare`), and the transaction timeout fits under the broker's maximum."""
        kafka = self.config.kafka
        unwritten = unwritten_columns(self.config.columns)
        if unwritten:
            logger.warning("%s sink %s: the stream's columns %s are not written: the sink writes key and value into "
                           "topic %s, partitioned by the key (Spark's Kafka sink would use them)", FORMAT, self.sink_id,
                           ", ".join(unwritten), self.config.topic)
        metadata = check_access(kafka)  # a refused password or certificate fails here, at once and by name
        create_topic(kafka, self.config.topic, partitions=self.config.partitions, metadata=metadata)
        if self.config.dead_letter_topic:
            create_topic(kafka, self.config.dead_letter_topic, partitions=1, metadata=metadata)
        if self.config.protocol == "at-least-once":
            return
        self.markers.prepare(resumed, metadata)
        maximum = int(broker_settings(kafka, metadata)["transaction.max.timeout.ms"])
        if self.config.transaction_timeout_ms > maximum:
            raise ConfigError(
                f"{FORMAT} sink {self.sink_id}: transaction_timeout_ms {self.config.transaction_timeout_ms} is above the "
                f"broker's transaction.max.timeout.ms {maximum}; lower it or raise the broker's maximum"
            )

    def recorded_owner(self) -> SinkOwner | None:
        """From the owner record of the sink's marker topic (none for at-least-once, which
        keeps no markers to share)."""
        return None if self.config.protocol == "at-least-once" else self.markers.owner()

    def take_epoch(self, floor: int) -> int:
        """Driver, at a run's start: the sink's epoch register is its owner record, raised by
        compare-and-set (:meth:`MarkerLog.take_epoch`); at-least-once keeps none."""
        if self.config.protocol == "at-least-once":
            return floor + 1
        return self.markers.take_epoch(floor)

    def hold_epoch(self, epoch: int) -> None:
        if self.config.protocol != "at-least-once":
            self.markers.hold_epoch(epoch)

    def record_owner(self, owner: SinkOwner) -> None:
        if self.config.protocol != "at-least-once":
            self.markers.record_owner(owner, self.epoch)

    def reset(self) -> None:
        """Every writer's latest batch marker becomes an empty one of this run's epoch, written
        under the writer's own transactional id (:meth:`MarkerLog.reset`)."""
        if self.config.protocol != "at-least-once":
            self.markers.reset(self.transactional_id_of, self.epoch)

    def transactional_id_of(self, writer: int) -> KafkaTransactionalId:
        """The transactional id that writes ``writer``'s markers: a task's partition's."""
        return KafkaTransactionalId(self.sink_id, writer)

    # -- clients -------------------------------------------------------------------------------

    def _new_producer(self, **extra: Any) -> SinkProducer:
        """A producer connected to a broker (:func:`~oncekit.connectors.kafka.connect_producer`:
        a task makes a new producer whenever Spark runs a partition on another Python worker
        than last time, which on a live stream is most batches). Delivery reports for failed
        records only: no Python callback per delivered record."""
        return connect_producer(SinkProducer(self.config.kafka.settings(
            linger_ms=5, delivery_report_only_error=True, queue_buffering_max_messages=1_000_000,
            reconnect_backoff_ms=10, logger=_CLIENT_LOG, **extra)), self.config.topic)

    def take_producer(self, transactional_id: KafkaTransactionalId | None, fresh: bool = False) -> SinkProducer:
        """A producer of this process's pool (a new one when ``fresh``): idempotent (``None``) or
        transactional. A new transactional producer runs ``init_transactions``, which fences
        every earlier producer with the same id and aborts the transaction it left open; one taken
        from the pool was initialised by an earlier task. If a producer of another process on
        this machine has been initialised since (:class:`LatestInit` says so), the pooled one is
        fenced for sure and a new one is made at once; if one on another machine has, its first
        transactional call fails fatally and :meth:`commit_with_fencing` starts over with a
        fresh one."""
        key = (*self._client_key, str(transactional_id))

        def make() -> SinkProducer:
            if transactional_id is None:
                return self._new_producer(enable_idempotence=True)
            producer = self._new_producer(transactional_id=str(transactional_id),
                                          transaction_timeout_ms=self.config.transaction_timeout_ms)
            bounded(f"{FORMAT} sink {self.sink_id} txn {transactional_id}: init_transactions", INIT_S + GRACE_S,
                    producer.init_transactions, INIT_S)
            LATEST_INIT.record(transactional_id)
            return producer

        if transactional_id is not None and not fresh and not LATEST_INIT.here(transactional_id):
            CLIENTS.discard(key)
            fresh = True
        return make() if fresh else CLIENTS.take(key, make)

    def give_producer(self, transactional_id: KafkaTransactionalId | None, producer: SinkProducer) -> None:
        producer.fresh = False
        CLIENTS.give((*self._client_key, str(transactional_id)), producer)

    # -- writing -------------------------------------------------------------------------------

    def produce(self, producer: SinkProducer, records: Records, where: str, first_row: int = 0) -> None:
        """Queue every record of ``records`` (rows numbered from ``first_row``). The records go
        to librdkafka through ``map`` over Arrow-made lists, so no Python code runs per record;
        only a record the client refuses stops it: a full local queue waits for deliveries, a
        record over the broker's size goes to the dead-letter topic if there is one, else fails
        the task with RecordError naming its row. Any other refusal is the producer's, the
        transaction's or the topic's, not the record's: it is raised as the KafkaException it
        is. Failed deliveries land in ``producer.failures``."""
        topic, values, keys = self.config.topic, records.python_values, records.python_keys
        remaining_values, remaining_keys = iter(values), iter(keys)
        send = producer.produce  # positional (topic, value, key): keyword arguments cost a dict per record
        while True:
            try:
                collections.deque(map(send, itertools.repeat(topic), remaining_values, remaining_keys), maxlen=0)
                return
            except BufferError:  # the local queue is full: let deliveries drain it, then go on
                row = len(values) - operator.length_hint(remaining_values) - 1
                produce_when_room(producer, topic, values[row], keys[row])
            except KafkaException as exc:
                if exc.args[0].code() != KafkaError.MSG_SIZE_TOO_LARGE:
                    # Not the record's fault (fenced, the transaction's state, the topic): the
                    # caller names sink, batch, partition and transaction (commit_with_fencing).
                    raise
                row = len(values) - operator.length_hint(remaining_values) - 1
                if not self.config.dead_letter_topic:
                    raise RecordError(f"{where}: row {first_row + row}: {exc.args[0].str()}") from exc
                produce_when_room(producer, self.config.dead_letter_topic, key=keys[row],
                                  value=(values[row] or b"")[:1024],
                                  headers={"oncekit.error": f"{where}: row {first_row + row}: too large"})

    def publish(self, producer: SinkProducer, records: RecordStream, writer: int, batch_id: int,
                where: str, marker_of: Callable[[int, str], BatchMarker | None]) -> int:
        """Write ``records`` and ``writer``'s batch marker in one transaction, and commit it;
        return the rows written. Records are produced part by part as they arrive, so librdkafka
        sends while Spark still delivers the task's input, and the commit waits only for the
        last part. ``marker_of`` hears the rows and checksum once the last part is in and gives
        the marker to commit them with; None aborts the transaction, and nothing is written (0
        is returned).

        Input slower than the transaction may stay open (Spark computing an expensive upstream,
        a catch-up batch after downtime) would have the coordinator abort it, and every retry
        would compute the same slow input again: once the transaction has been open half its
        timeout with input still coming, it is aborted, the rest of the input is only kept, and
        the whole partition goes in a new transaction once it is in.

        The marker goes last, right before the commit, so the marker partition holds an open
        transaction for one round trip only. A pooled producer that a newer one has fenced
        fails at its first part (adding a partition to the transaction is a round trip to the
        coordinator), having sent nothing that can become visible. A fatal error (fenced) is
        raised as it is, for :meth:`commit_with_fencing`; a commit or abort that does not
        return in time raises StallError."""
        self.markers.ensure_writer(writer)
        producer.failures.clear()
        producer.begin_transaction()
        budget_s = self.config.transaction_timeout_ms / 2000
        try:
            rows = crc_total = 0
            opened: float | None = None  # when the first record went in: the coordinator's clock starts then
            streaming = True
            for part in records:
                if streaming and opened is not None and clock.monotonic() - opened > budget_s:
                    logger.info("%s: input still coming after %.0f s of an open transaction; producing the whole "
                                "partition in a new one once it is in", where, budget_s)
                    _abort_transaction(producer, where)
                    streaming = False
                if streaming:
                    opened = opened or clock.monotonic()
                    self.produce(producer, part, where, first_row=rows)
                rows += len(part)
                crc_total += part.crc_total
            if not streaming:
                producer.begin_transaction()
                producer.failures.clear()  # the aborted records' reports
                produced = 0
                for part in records:  # the kept parts, again
                    self.produce(producer, part, where, first_row=produced)
                    produced += len(part)
            total = checksum(rows, crc_total)
            marker = marker_of(rows, total)
            if marker is None:
                _abort_transaction(producer, where)
                return 0
            self.markers.produce(producer, writer, marker)
            crash_point("kafka_commit", batch_id, writer)
            _commit_transaction(producer, where)
            if producer.failures:  # commit refuses a transaction with failed records; belt and braces
                raise RecordError(f"{where}: records were not delivered: {producer.failures[0]}")
            return rows
        except KafkaException as exc:
            if not exc.args[0].fatal():
                _abort_transaction(producer, where)
            raise
        except StallError:
            raise  # the producer is left to its stuck call; the caller drops it
        except BaseException:
            _abort_transaction(producer, where)
            raise

    def commit_with_fencing(self, transactional_id: KafkaTransactionalId, where: str,
                            attempt: Callable[[SinkProducer], int]) -> int:
        """Run ``attempt`` (read the marker, publish) with this worker's transactional producer
        of the id, kept across tasks and batches (a new one costs ``init_transactions``, one or
        more round trips to the coordinator per task). Zombies stay fenced: of all producers of
        an id only the one initialised last can write; if that is not this one (another
        worker's attempt of the partition initialised since), its first transactional call
        fails fatally and ``attempt`` runs once more with a fresh producer, whose
        ``init_transactions`` fences the other and aborts what it left open. The same happens
        when the marker read cannot settle with the pooled producer (UnsettledMarkerError). The
        marker read inside ``attempt`` makes the rerun write nothing if the other attempt
        committed.
        A producer that failed in any way is dropped, never given back. Kafka errors are raised
        naming sink, batch, partition and transaction (and init_transactions when making the
        producer failed)."""
        producer: SinkProducer | None = None  # None while a producer is being made (init_transactions)
        try:
            producer = self.take_producer(transactional_id)
            try:
                result = attempt(producer)
            except (KafkaException, UnsettledMarkerError) as exc:
                if isinstance(exc, KafkaException) and not exc.args[0].fatal() or producer.fresh:
                    raise
                logger.info("%s txn %s: %s; starting over with a new producer", where, transactional_id,
                            exc.args[0].str() if isinstance(exc, KafkaException) else exc)
                producer = None
                producer = self.take_producer(transactional_id, fresh=True)
                result = attempt(producer)
        except KafkaException as exc:
            # A commit that failed for records names them only in their delivery reports.
            text = ("init_transactions: " if producer is None else "") + exc.args[0].str() + (
                f" ({producer.failures[0]})" if producer is not None and producer.failures else "")
            # A deleted topic shows as an unknown topic, or, while the producer's metadata still
            # lists it, as an unknown partition in a record's delivery report, or as records timed
            # out (when the transaction timeout ends their wait before the metadata tells).
            gone = exc.args[0].code() == KafkaError.UNKNOWN_TOPIC_OR_PART or "Unknown topic" in text \
                or "Unknown partition" in text or (
                    "Message timed out" in text and producer is not None and producer.topic_missing(self.config.topic))
            hint = (f"; topic {self.config.topic} is gone (deleted while the query ran?): restart the query, whose "
                    "preflight creates it again, and the batch is replayed") if gone else ""
            raise OncekitError(f"{where}: transaction {transactional_id} failed: {text}{hint}") from exc
        self.give_producer(transactional_id, producer)
        return result


class LatestInit:
    """Which process of this machine initialised a transactional id's producer last: a file per
    id under the temporary directory, holding the pid. Spark hands a partition's task to any of
    its Python workers, and each worker pools its own producer of the partition's id, so a
    pooled producer is often one that another worker's newer producer has fenced. Using it costs
    a failed round trip and a producer dropped mid-transaction; this record lets the task make
    a new one at once instead. A hint only: Kafka's fencing still decides, so a record that is
    stale, missing or from another machine costs time, never correctness."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def record(self, transactional_id: KafkaTransactionalId) -> None:
        """After ``init_transactions``: this process now holds the id's newest producer."""
        try:
            self.folder.mkdir(exist_ok=True)
            scratch = self.folder / f".{transactional_id}.{os.getpid()}"
            scratch.write_text(str(os.getpid()))
            os.replace(scratch, self.folder / str(transactional_id))
        except OSError:
            pass  # no record: pooled producers are tried, and fencing tells

    def here(self, transactional_id: KafkaTransactionalId) -> bool:
        """Whether no other process of this machine initialised a producer of the id since this
        one did (true when there is no record to tell)."""
        try:
            return (self.folder / str(transactional_id)).read_text() == str(os.getpid())
        except OSError:
            return True


LATEST_INIT = LatestInit(Path(tempfile.gettempdir()) / "oncekit-transactional-ids")


def _commit_transaction(producer: SinkProducer, where: str) -> None:
    """Commit within :data:`COMMIT_S`, retrying what the client marks retriable; StallError when
    the client does not answer in time."""
    deadline = clock.monotonic() + COMMIT_S
    while True:
        remaining = max(1.0, deadline - clock.monotonic())
        try:
            bounded(f"{where}: commit_transaction", remaining + GRACE_S, producer.commit_transaction, remaining)
            return
        except KafkaException as exc:
            if not exc.args[0].retriable() or clock.monotonic() >= deadline:
                raise
            logger.info("%s: commit_transaction again after %s", where, exc.args[0].str())
            clock.sleep(0.5)


def _abort_transaction(producer: SinkProducer, where: str) -> None:
    bounded(f"{where}: abort_transaction", ABORT_S + GRACE_S, producer.abort_transaction, ABORT_S)

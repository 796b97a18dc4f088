"""The harness's input and output: it produces the input to Kafka, creates the output, and
reads back what was committed (Kafka with read_committed, PostgreSQL tables) and what was left
open (Kafka transactions, PostgreSQL prepared transactions).
"""

from __future__ import annotations

import random
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, Producer, TopicPartition
from psycopg import sql

from oncekit.connectors import KafkaConfig, postgres
from oncekit.connectors.kafka import client_log, produce_when_room
from oncekit.connectors.kafka_admin import create_topic
from oncekit.connectors.postgres import connect
from oncekit.core.names import MarkerTopic
from oncekit.sinks.postgres._common import CHECKPOINT_TABLE, MARKER_TABLE
from oncekit.verify.examples import COUNT, EXAMPLES, sink_kind


@dataclass(frozen=True)
class Upstream:
    """Faults of the input itself, as fractions of the records: ``duplicates`` are sent twice
    (a producer retry: the output must carry them twice, as the input has them twice),
    ``malformed`` records are not integers (the pipeline must drop or dead-letter them), ``late``
    records carry a Kafka timestamp an hour old (an identity pipeline carries them)."""

    duplicates: float = 0.0
    malformed: float = 0.0
    late: float = 0.0
    seed: int = 0


def produce_input(kafka: KafkaConfig, topic: str, count: int = COUNT, partitions: int = 2, first: int = 0,
                  upstream: Upstream | None = None) -> list[int]:
    """Values ``first``..``first+count-1`` over the partitions in one committed transaction (with
    ``upstream``'s duplicates, malformed and late records mixed in), plus 50 negative ones in an
    aborted transaction that must never arrive. Returns the expected ids, as a multiset."""
    upstream = upstream or Upstream()
    rng = random.Random(f"{upstream.seed}-{first}")
    late_ms = int((time.time() - 3600) * 1000)
    records: list[tuple[bytes, int, int | None]] = []
    expected: list[int] = []
    for i in range(first, first + count):
        late = late_ms if rng.random() < upstream.late else None
        copies = 2 if rng.random() < upstream.duplicates else 1
        records += [(str(i).encode(), i % partitions, late)] * copies
        expected += [i] * copies
        if rng.random() < upstream.malformed:
            records.append((f"malformed-{i}".encode(), i % partitions, None))
    producer = Producer(kafka.settings(transactional_id=f"input-{topic}", linger_ms=5))
    producer.init_transactions(30)
    aborted = [(str(i).encode(), i % partitions, None) for i in range(-first - 50, -first)]
    for batch, commit in ((records, True), (aborted, False)):
        producer.begin_transaction()
        for value, partition, timestamp in batch:
            produce_when_room(producer, topic, value=value, partition=partition, timestamp=timestamp or 0)
        if commit:
            producer.commit_transaction(30)
        else:
            producer.flush(30)
            producer.abort_transaction(30)
    return expected


def prepare_target(sink: str, kafka: KafkaConfig, dsn: str, target: str) -> None:
    """Create the output of pipeline ``sink`` (an example's name or ``module:function``): a
    two-partition topic, or a table ``(id, payload)`` keyed by id for idempotent sinks."""
    example = EXAMPLES.get(sink)
    kind = example.kind if example else sink_kind(sink)
    if kind in ("kafka", "fan-out"):
        create_topic(kafka, target, partitions=2)
    if kind == "kafka":
        return
    keyed = example is not None and example.protocol == "idempotent"
    with connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE TABLE IF NOT EXISTS {} (id bigint {}, payload text)").format(
            sql.Identifier(target), sql.SQL("PRIMARY KEY" if keyed else "NOT NULL")))


def read_committed(kafka: KafkaConfig, topic: str, expected: int, timeout_s: float = 30.0) -> list[bytes]:
    """Every value a read_committed consumer sees in ``topic``: waits for ``expected`` values,
    then one more second so that extra values would show."""
    values: list[bytes] = []
    deadline = time.monotonic() + timeout_s
    settle = None
    with KafkaOutput(kafka, topic) as output:
        while time.monotonic() < deadline:
            values = output.read()
            if len(values) >= expected:
                settle = settle or time.monotonic() + 1.0
                if time.monotonic() > settle:
                    break
    return values


class KafkaOutput:
    """A read_committed consumer of a whole topic, kept open between reads: :meth:`read` returns
    every committed value seen so far, one per (partition, offset), so that a consumer that
    reconnects and reads a stretch again never counts a record twice (a duplicate the sink wrote
    has an offset of its own). :meth:`open_transactions` names the partitions whose last stable
    offset lags the high watermark, i.e. that hold a transaction still open."""

    def __init__(self, kafka: KafkaConfig, topic: str) -> None:
        self.kafka, self.topic = kafka, topic
        self.records: dict[tuple[int, int], bytes] = {}
        self.consumer = self._consumer()

    def _consumer(self) -> Consumer:
        consumer = Consumer(self.kafka.consumer_settings(group_id=f"check-{self.topic}", isolation_level="read_committed",
                                                         enable_auto_commit=False))
        # assign, not subscribe: no group membership to lose (and restart from "earliest") in a broker outage
        partitions = consumer.list_topics(self.topic, timeout=30).topics[self.topic].partitions
        consumer.assign([TopicPartition(self.topic, p, OFFSET_BEGINNING) for p in sorted(partitions)])
        return consumer

    def reconnect(self) -> None:
        """Read the topic again from the start with a new consumer: after a network cut the old
        one can wait out socket timeouts (a minute) before it reads again. Values already seen
        keep their (partition, offset), so nothing is counted twice."""
        self.consumer.close()
        self.consumer = self._consumer()

    def __enter__(self) -> KafkaOutput:
        return self

    def __exit__(self, *exc: object) -> None:
        self.consumer.close()

    def read(self, timeout_s: float = 0.5) -> list[bytes]:
        for message in self.consumer.consume(1000, timeout=timeout_s):
            if message.error() is None:
                self.records[(message.partition() or 0, message.offset() or 0)] = message.value() or b""
        return list(self.records.values())

    def open_transactions(self) -> list[int]:
        return [partition for partition, (stable, high) in self.offsets().items() if stable < high]

    def offsets(self) -> dict[int, tuple[int, int]]:
        """Per partition: (last stable offset, high watermark)."""
        metadata = self.consumer.list_topics(self.topic, timeout=10).topics[self.topic]
        uncommitted = Consumer(self.kafka.settings(group_id="oncekit-watermarks", isolation_level="read_uncommitted"))
        try:
            found = {}
            for partition in sorted(metadata.partitions):
                tp = TopicPartition(self.topic, partition)
                stable = self.consumer.get_watermark_offsets(tp, timeout=10, cached=False)[1]
                found[partition] = (stable, uncommitted.get_watermark_offsets(tp, timeout=10, cached=False)[1])
            return found
        finally:
            uncommitted.close()

    def await_stable(self, timeout_s: float) -> bool:
        """Wait until every partition's last stable offset reaches its high watermark of now, or
        ``timeout_s``; whether it did. A producer's commit returns once the transaction is decided,
        and the broker writes its commit markers after that (after a broker restart, once the
        coordinator has reloaded): until then read_committed readers do not see the records of
        a transaction that is already committed."""
        deadline = time.monotonic() + timeout_s
        try:
            targets = {partition: high for partition, (_, high) in self.offsets().items()}
            while True:
                if all(self.offsets()[partition][0] >= high for partition, high in targets.items()):
                    return True
                if time.monotonic() >= deadline:
                    return False
                time.sleep(0.5)
        except (KafkaException, KeyError):
            return False


def table_ids(dsn: str, table: str) -> list[int]:
    with connect(dsn) as conn:
        return [row[0] for row in conn.execute(sql.SQL("SELECT id FROM {}").format(sql.Identifier(table)))]


def prepared_transactions(dsn: str, target: str = "") -> list[str]:
    """The prepared transactions in ``dsn``'s database, whoever made them, of the sinks whose id
    names ``target`` if given (runs that share a database judge only their own leftovers): the
    harness checks that none is left behind."""
    with connect(dsn) as conn:
        return [gid for gid in postgres.prepared_transactions(conn, prefix="") if target in gid]


def committed_output(sink: str, kafka: KafkaConfig, dsn: str, target: str, expected: int) -> list[int]:
    if EXAMPLES[sink].kind == "kafka":
        return [int(v) for v in read_committed(kafka, target, expected, timeout_s=60)]
    return table_ids(dsn, target)


class PipelineOutput:
    """What a pipeline of kind ``kind`` (postgres, kafka or fan-out: :func:`sink_kind`) committed
    to ``target`` (its table, its topic, or both of one name), read back as the harness judges
    it: ids, or (target, id) pairs for a fan-out, so that each target is held to exactly-once on
    its own. Called by the campaigns (:mod:`oncekit.verify.campaign`) and the standby tests."""

    def __init__(self, kind: str, kafka: KafkaConfig, dsn: str, target: str) -> None:
        self.kind, self.dsn, self.target = kind, dsn, target
        self.kafka = KafkaOutput(kafka, target) if kind in ("kafka", "fan-out") else None

    def read(self) -> list[Hashable]:
        """Every record committed so far."""
        table = table_ids(self.dsn, self.target) if self.kind != "kafka" else []
        topic = [int(v) for v in self.kafka.read(0.2)] if self.kafka is not None else []
        records: list[Hashable] = []
        if self.kind == "fan-out":
            records += [("table", i) for i in table] + [("topic", i) for i in topic]
        else:
            records += topic if self.kind == "kafka" else table
        return records

    def wanted(self, ids: Sequence[int]) -> list[Hashable]:
        """What :meth:`read` must hold for input ``ids``: each once (once per target for a fan-out)."""
        if self.kind == "fan-out":
            return [(target, i) for target in ("table", "topic") for i in ids]
        return [*ids]

    def left_open(self, checkpoint: str | None = None) -> list[str]:
        """What the pipeline left open: prepared transactions of its sinks, partitions with an open
        Kafka transaction, and (given its ``checkpoint``) staged files not yet published."""
        left = [f"prepared transaction {gid}" for gid in prepared_transactions(self.dsn, self.target)] \
            if self.kind != "kafka" else []
        if self.kafka is not None:
            left += [f"open transaction in {self.target}[{p}]" for p in self.kafka.open_transactions()]
        if checkpoint is not None:
            left += [f"staged file {path}" for path in sorted(Path(checkpoint, "oncekit").glob("*/staged/**/*.arrow"))]
        return left

    def close(self) -> None:
        if self.kafka is not None:
            self.kafka.__exit__()


def kit_rows(dsn: str, target: str) -> int:
    """Rows the kit keeps beside the target for the sinks whose id names ``target``: marker rows
    of two-phase commit and recorded checkpoints of the write-ahead log (the soak watches them)."""
    total = 0
    with connect(dsn) as conn:
        for table in (MARKER_TABLE, CHECKPOINT_TABLE):
            if conn.execute("SELECT to_regclass(%s)", (table,)).fetchone() != (None,):
                row = conn.execute(sql.SQL("SELECT count(*) FROM {} WHERE strpos(sink_id, %s) > 0").format(
                    sql.Identifier(table)), (target,)).fetchone()
                total += int(row[0]) if row else 0
    return total


def marker_partitions(kafka: KafkaConfig, target: str) -> int:
    """Partitions of the marker topics of the kit's Kafka sinks whose id names ``target``: one
    for the owner record and one per writer (:class:`~oncekit.core.names.MarkerTopic`)."""
    from confluent_kafka.admin import AdminClient

    admin = AdminClient(kafka.settings(logger=client_log(__name__ + ".librdkafka")))
    topics = admin.list_topics(timeout=30).topics
    prefix = str(MarkerTopic(""))
    return sum(len(t.partitions) for name, t in topics.items() if name.startswith(prefix) and target in name)

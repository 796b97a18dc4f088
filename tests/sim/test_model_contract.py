"""The simulation's models answer as the real services do: the same primitive operations, run
against the real PostgreSQL and Kafka of the suite and against the models, give the same
transcript (who is fenced, what is prepared, recorded or visible, what a read_committed reader
sees). What the models leave out is listed in their modules' docstrings; the lock bounds are
proven on the real server by tests/integration/test_overlapping_runs.py."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pytest
from confluent_kafka import KafkaException, TopicPartition
from confluent_kafka.admin import NewTopic

from oncekit.connectors import KafkaConfig
from oncekit.connectors.kafka import clients_for, register_clients
from oncekit.core.errors import OncekitError
from oncekit.core.protocol import TaskInfo
from oncekit.sinks.postgres import postgres_sink
from oncekit.sinks.postgres._psycopg import PsycopgTarget
from oncekit.sinks.postgres._target import PostgresTarget
from tests.sim import kafka as kafka_model
from tests.sim.postgres import PgServer, SimPostgresTarget
from tests.sim.scheduler import Choices, Process, Scheduler

pytestmark = pytest.mark.services


def in_simulation(scheduler: Scheduler, call: Callable[[], Any]) -> Any:
    """Run ``call`` as the one actor of ``scheduler``; its result (its error raised)."""
    out: list[Any] = []
    actor = scheduler.spawn("contract", Process("contract"), lambda: out.append(call()))
    scheduler.run(100_000)
    if actor.error is not None:
        raise actor.error
    return out[0]


def outcome(call: Callable[[], Any]) -> Any:
    """What a call answered, or the kind of error it raised."""
    try:
        return call()
    except OncekitError as exc:
        return type(exc).__name__
    except KafkaException as exc:
        return f"KafkaException(fatal={exc.args[0].fatal()})"


def rows(ids: list[int]) -> pa.RecordBatch:
    return pa.record_batch([pa.array(ids, pa.int32()), pa.array([str(i) for i in ids])], names=["id", "payload"])


def postgres_transcript(target_of: Callable[[str], PostgresTarget]) -> list[Any]:
    """Epochs, decisions, prepared transactions, publishes and upserts, as the protocols use them."""
    two_phase, wal, upsert = target_of("two-phase-commit"), target_of("write-ahead-log"), target_of("idempotent")
    out: list[Any] = []
    for target in (two_phase, wal, upsert):
        target.preflight()
    first = two_phase.take_epoch("cp", 0)
    second = two_phase.take_epoch("cp", 0)
    out += [second - first, outcome(lambda: two_phase.hold_epoch("cp", first)), outcome(lambda: two_phase.hold_epoch("cp", second + 5))]
    epoch = second + 5
    out += [outcome(lambda: two_phase.decide(0, first, "decided")), two_phase.decide(0, epoch, "decided"),
            two_phase.decide(0, epoch, "vetoed"), two_phase.decide(1, epoch, "vetoed"), two_phase.decide(1, epoch, "decided"),
            two_phase.decisions([0, 1, 2])]
    task = TaskInfo(two_phase.config.sink_id, 3, 0, 7, epoch)
    preparing = two_phase.begin(task)
    preparing.write(rows([1, 2]))
    out += [preparing.prepare(), [c.name for c in two_phase.prepared([3])]]
    stale = two_phase.begin(TaskInfo(two_phase.config.sink_id, 3, 1, 8, first))
    stale.write(rows([3]))
    out += [outcome(stale.prepare), [c.name for c in two_phase.prepared(None)]]
    out += [two_phase.finish_prepared(task.transaction_id, commit=True), two_phase.finish_prepared(task.transaction_id, commit=True),
            two_phase.marker_visible(task.transaction_id)]
    again = two_phase.begin(TaskInfo(two_phase.config.sink_id, 3, 0, 9, epoch))
    again.write(rows([1, 2]))
    out += [outcome(again.prepare), two_phase.prepared(None)]
    out += [two_phase.delete_batch_records("oncekit_markers", 4, epoch), two_phase.decisions([3]),
            outcome(lambda: two_phase.delete_batch_records("oncekit_decisions", None, first))]
    wal_epoch = wal.take_epoch("cp", 0)
    parts = lambda ids: iter([(TaskInfo(wal.config.sink_id, 0, 0, 0, wal_epoch), iter([rows(ids)]))])  # noqa: E731
    out += [wal.published(0), wal.publish(0, wal_epoch, 2, parts([5, 6])), wal.publish(0, wal_epoch, 2, parts([5, 6])),
            wal.published(0), outcome(lambda: wal.publish(1, wal_epoch - 1, 1, parts([7]))), wal.published(1)]
    upsert_epoch = upsert.take_epoch("cp", 0)
    write = lambda epoch, payload: upsert.write_and_commit(  # noqa: E731
        TaskInfo(upsert.config.sink_id, 0, 0, 0, epoch), iter([pa.record_batch(
            [pa.array([1], pa.int32()), pa.array([payload])], names=["id", "payload"])]), epoch)
    out += [write(upsert_epoch, "new"), outcome(lambda: write(upsert_epoch - 1, "old"))]
    out += [upsert.owner(), outcome(lambda: upsert.record_owner(__import__("oncekit").core.protocol.SinkOwner("q", "c"),
                                                                 upsert_epoch - 1))]
    return out


def test_the_postgresql_model_answers_as_the_server(postgres_dsn: str, unique_name: str, tmp_path: Path) -> None:
    def config(protocol: str, dsn: str, table: str) -> Any:
        keyed = protocol == "idempotent"
        return postgres_sink(dsn, table, protocol, sink_id=f"{table}-{protocol}", columns=("id", "payload"),
                             key_columns=("id",) if keyed else ())

    tables = {p: f"{unique_name}_{p.replace('-', '_')}" for p in ("two-phase-commit", "write-ahead-log", "idempotent")}
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        for protocol, table in tables.items():
            key = " PRIMARY KEY" if protocol == "idempotent" else ""
            conn.execute(f"CREATE TABLE {table} (id int NOT NULL{key}, payload text NOT NULL)")
    real = postgres_transcript(lambda protocol: PsycopgTarget(config(protocol, postgres_dsn, tables[protocol])))

    scheduler = Scheduler(Choices(0))
    server = PgServer(scheduler)
    model = in_simulation(scheduler, lambda: postgres_transcript(
        lambda protocol: SimPostgresTarget(config(protocol, "sim-postgres:contract", tables[protocol]), server)))
    assert model == real


def kafka_transcript(make: Callable[[dict[str, Any]], Any], servers: str, topic: str) -> list[Any]:
    """Transactions, fencing and read_committed, as the Kafka sinks use them."""
    clients = clients_for({"bootstrap.servers": servers})
    admin = clients.admin({"bootstrap.servers": servers})
    out: list[Any] = [outcome(lambda: admin.create_topics([NewTopic(topic, num_partitions=1)], operation_timeout=30)[topic].result(60))]
    out.append(outcome(lambda: admin.create_topics([NewTopic(topic, num_partitions=1)], operation_timeout=30)[topic].result(60)))
    settings = {"bootstrap.servers": servers, "transactional.id": f"{topic}-tx"}
    old = clients.producer(settings)
    old.init_transactions(30)
    old.begin_transaction()
    old.produce(topic, b"open", b"k", partition=0)
    old.flush(10)

    def read() -> tuple[list[bytes], int]:
        consumer = clients.consumer({"bootstrap.servers": servers, "group.id": f"{topic}-reader",
                                     "enable.partition.eof": True, "isolation.level": "read_committed",
                                     "enable.auto.commit": False})
        consumer.assign([TopicPartition(topic, 0, 0)])
        values, end = [], -1
        for _ in range(200):
            message = consumer.poll(5)
            if message is None:
                continue
            if message.error() is not None:
                end = message.offset()
                break
            values.append(message.value())
        consumer.close()
        return values, end

    out.append(read()[0])  # the open transaction hides its record
    new = clients.producer(settings)
    new.init_transactions(30)  # fences the old producer and aborts its transaction
    out.append(outcome(lambda: old.commit_transaction(10)))
    new.begin_transaction()
    new.produce(topic, b"committed", b"k", partition=0)
    new.commit_transaction(30)
    new.begin_transaction()
    new.produce(topic, b"aborted", b"k", partition=0)
    new.abort_transaction(30)
    plain = clients.producer({"bootstrap.servers": servers, "enable.idempotence": True})
    plain.produce(topic, b"plain", b"k", partition=0)
    plain.flush(30)
    values, end = read()
    out += [values, end >= 1]
    return out


def test_the_kafka_model_answers_as_the_broker(kafka: KafkaConfig, unique_name: str) -> None:
    topic = unique_name.replace("_", "-")
    real = kafka_transcript(lambda settings: None, kafka.bootstrap_servers, topic)
    scheduler = Scheduler(Choices(0))
    cluster = kafka_model.Cluster(scheduler)
    servers = f"{kafka_model.SERVERS_PREFIX}contract-{uuid.uuid4().hex[:6]}"
    register_clients(servers, kafka_model.Clients(cluster))
    model = in_simulation(scheduler, lambda: kafka_transcript(lambda settings: None, servers, topic))
    assert model == real

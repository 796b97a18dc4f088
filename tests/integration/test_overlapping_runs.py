"""Overlapping runs of one query, or of two queries on one sink id, on a real PostgreSQL server and
a real Kafka broker, driven directly (no Spark) with the interleavings that a careful read of the
engine found (issue 46, findings 1-6). Each test freezes one run at a chosen step, lets the other
act, then thaws the first: whatever the first does when it wakes must leave the newer run's output
exactly-once and the pipeline able to move on.

The simulation (tests/sim) explores such interleavings systematically; these are the ones found
by reading, kept as plain tests against the real services."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pytest

from oncekit.connectors import KafkaConfig
from oncekit.core.engine import CheckpointEngine
from oncekit.core.errors import FencedError, OncekitError
from oncekit.core.protocol import SinkOwner, TaskInfo
from oncekit.sinks.kafka import kafka_sink
from oncekit.sinks.postgres import postgres_sink
from oncekit.verify.io import read_committed
from tests.integration.test_postgres_recovery import rows, spark_logged

pytestmark = pytest.mark.services

PROTOCOLS = ("two-phase-commit", "write-ahead-log")


def table(dsn: str, name: str, keyed: bool = False) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE IF NOT EXISTS {name} (id int NOT NULL{' PRIMARY KEY' if keyed else ''}, "
                     "payload text NOT NULL)")


def table_ids(dsn: str, name: str) -> collections.Counter[int]:
    with psycopg.connect(dsn) as conn:
        return collections.Counter(r[0] for r in conn.execute(f"SELECT id FROM {name}"))


def prepared(dsn: str, sink_id: str) -> list[str]:
    with psycopg.connect(dsn) as conn:
        return [r[0] for r in conn.execute("SELECT gid FROM pg_prepared_xacts WHERE gid LIKE %s", (f"oncekit:{sink_id}:%",))]


def run(dsn: str, name: str, checkpoint: Path, protocol: str, token: str, start: bool = True, **options: Any
        ) -> CheckpointEngine:
    """A query run's engine on ``checkpoint``: preflighted, and started (epoch, recovery, claim)
    unless ``start`` is False."""
    config = postgres_sink(dsn, name, protocol, columns=("id", "payload"), **options)
    engine = CheckpointEngine(config.build(str(checkpoint)), str(checkpoint))
    engine.preflight()
    if start:
        engine.start_run(token)
    return engine


def frozen_at(method: Callable[..., Any], call: int, meanwhile: Callable[[], None]) -> Callable[..., Any]:
    """``method``, whose ``call``-th call (from 1) lets ``meanwhile`` run first: the run that calls
    it froze there, and another run acted while it slept."""
    calls = [0]

    def frozen(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == call:
            meanwhile()
        return method(*args, **kwargs)

    return frozen


def once(call: Callable[[], None]) -> Callable[[], None]:
    """``call``, run at its first call only: a run acts once, wherever the other froze."""
    done: list[bool] = []

    def first() -> None:
        if not done:
            done.append(True)
            call()

    return first


# -- finding 1: a superseded run's recovery rolls back a newer run's work -------------------------

@pytest.mark.parametrize("call", [1, 2])
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_run_superseded_inside_its_recovery_leaves_the_newer_runs_batch_alone(
    postgres_dsn: str, unique_name: str, tmp_path: Path, protocol: str, call: int,
) -> None:
    """Run A starts recovering; its host freezes past its lease (at its ``call``-th look at what
    the target holds open); run B takes over, runs and completes batch 1; A thaws and goes on
    recovering. Whatever A does then, batch 1 is committed exactly once and nothing stays open."""
    table(postgres_dsn, unique_name)
    spark_logged(tmp_path, planned=[0], committed=[0])
    a = run(postgres_dsn, unique_name, tmp_path, protocol, "a", start=False)
    b = run(postgres_dsn, unique_name, tmp_path, protocol, "b", start=False)
    sink_id = a.sink.sink_id

    @once
    def b_takes_over_and_runs_batch_1() -> None:
        b.start_run("b")
        spark_logged(tmp_path, planned=[0, 1], committed=[0])
        b.checkpoint(1, b.write_task(TaskInfo(sink_id, 1, 0, 0, epoch=b.epoch), iter([rows([7, 8])])))
        spark_logged(tmp_path, planned=[0, 1], committed=[0, 1])

    a.sink.leftovers = frozen_at(a.sink.leftovers, call, b_takes_over_and_runs_batch_1)  # type: ignore[method-assign]
    try:
        a.start_run("a")
    except FencedError:
        pass  # A found out it was superseded: as good as touching nothing
    b_takes_over_and_runs_batch_1()  # if A's recovery looked fewer times
    b.complete()
    assert table_ids(postgres_dsn, unique_name) == collections.Counter([7, 8])
    assert prepared(postgres_dsn, sink_id) == []


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_run_superseded_while_it_aborts_an_old_batch_keeps_the_newer_runs_journal_entry(
    postgres_dsn: str, unique_name: str, tmp_path: Path, protocol: str,
) -> None:
    """An earlier run journaled batch 1 and died before Spark logged it. Run A recovers and starts
    aborting that batch; its host freezes there; run B takes over, replays batch 1, journals it
    and Spark logs it; A thaws and finishes its abort. B's batch 1 must still be committed."""
    table(postgres_dsn, unique_name)
    spark_logged(tmp_path, planned=[0, 1], committed=[0])
    dead = run(postgres_dsn, unique_name, tmp_path, protocol, "dead")
    sink_id = dead.sink.sink_id
    dead.checkpoint(1, dead.write_task(TaskInfo(sink_id, 1, 0, 0, epoch=dead.epoch), iter([rows([7, 8])])))
    a = run(postgres_dsn, unique_name, tmp_path, protocol, "a", start=False)
    b = run(postgres_dsn, unique_name, tmp_path, protocol, "b", start=False)

    @once
    def b_takes_over_and_runs_batch_1() -> None:
        b.start_run("b")
        b.checkpoint(1, b.write_task(TaskInfo(sink_id, 1, 0, 1, epoch=b.epoch), iter([rows([7, 8])])))
        spark_logged(tmp_path, planned=[0, 1], committed=[0, 1])

    a.sink.abort_batch = frozen_at(a.sink.abort_batch, 1, b_takes_over_and_runs_batch_1)  # type: ignore[method-assign]
    a.sink.commit_batch = frozen_at(a.sink.commit_batch, 1, b_takes_over_and_runs_batch_1)  # type: ignore[method-assign]
    try:
        a.start_run("a")
    except FencedError:
        pass
    b_takes_over_and_runs_batch_1()  # if A's recovery neither aborted nor committed the batch
    b.complete()
    assert table_ids(postgres_dsn, unique_name) == collections.Counter([7, 8])
    assert prepared(postgres_dsn, sink_id) == []


def test_a_run_that_finishes_its_start_after_a_newer_run_leaves_the_newer_run_recorded(
    postgres_dsn: str, unique_name: str, tmp_path: Path,
) -> None:
    """Run A freezes at the end of its start; run B starts meanwhile; A thaws and finishes. The
    journal must still name B as the query's newest run (B's Spark Connect committer serves only
    while it does)."""
    table(postgres_dsn, unique_name)
    spark_logged(tmp_path, planned=[0], committed=[0])
    a = run(postgres_dsn, unique_name, tmp_path, "two-phase-commit", "a", start=False)
    b = run(postgres_dsn, unique_name, tmp_path, "two-phase-commit", "b", start=False)
    a.journal.record_epoch = frozen_at(a.journal.record_epoch, 1, lambda: b.start_run("b"))  # type: ignore[method-assign]
    try:
        a.start_run("a")
    except FencedError:
        pass
    assert b.journal.run() == "b"


# -- finding 2: two runs of a Kafka-only query take the same epoch -----------------------------

def test_two_runs_of_a_kafka_query_never_take_the_same_epoch(kafka: KafkaConfig, unique_name: str, tmp_path: Path) -> None:
    """Two standbys find the lease void together and both start: their epochs, taken from the
    same floor, must differ (the lower one is fenced; with equal epochs neither is)."""
    topic = unique_name.replace("_", "-")
    config = kafka_sink(kafka.bootstrap_servers, topic, "write-ahead-log", partitions=1)
    first, second = config.build(str(tmp_path)), config.build(str(tmp_path))
    first.preflight()
    epochs = [first.take_epoch(0), second.take_epoch(0)]
    assert epochs[0] != epochs[1]
    assert first.take_epoch(0) > max(epochs)



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


# -- finding 4: taking over a sink id is not fenced --------------------------------------------

def test_a_retired_querys_prepared_transaction_never_lands_in_the_new_querys_batch(
    postgres_dsn: str, unique_name: str, tmp_path: Path,
) -> None:
    """Query 1 prepared batch 0 and its checkpoint was deleted (retired) while its driver slept;
    query 2, a new checkpoint, takes the sink id over and plans its own batch 0. Query 1's driver
    wakes and commits its prepared transaction. Query 2's batch 0 must still be written whole."""
    table(postgres_dsn, unique_name)
    retired, fresh = tmp_path / "retired", tmp_path / "fresh"
    spark_logged(retired, planned=[0], committed=[])
    (retired / "metadata").write_text('{"id": "query-1"}')
    q1 = run(postgres_dsn, unique_name, retired, "two-phase-commit", "q1")
    sink_id = q1.sink.sink_id
    held = q1.write_task(TaskInfo(sink_id, 0, 0, 0, epoch=q1.epoch), iter([rows([1, 2])]))
    q1.checkpoint(0, held)
    for path in sorted(retired.rglob("*"), reverse=True):  # retired: its checkpoint is deleted
        path.unlink() if path.is_file() else path.rmdir()

    spark_logged(fresh, planned=[0], committed=[])
    (fresh / "metadata").write_text('{"id": "query-2"}')
    q2 = run(postgres_dsn, unique_name, fresh, "two-phase-commit", "q2")
    try:
        q1.sink.commit_batch(0, held)  # query 1's driver wakes up in its commit
    except OncekitError:
        pass
    q2.checkpoint(0, q2.write_task(TaskInfo(sink_id, 0, 0, 0, epoch=q2.epoch), iter([rows([10, 11])])))
    spark_logged(fresh, planned=[0], committed=[0])
    q2.complete()
    assert {10, 11} <= set(table_ids(postgres_dsn, unique_name))
    assert prepared(postgres_dsn, sink_id) == []


def test_a_retired_querys_kafka_task_never_marks_the_new_querys_batch_as_written(
    kafka: KafkaConfig, unique_name: str, tmp_path: Path,
) -> None:
    """Query 1's task for batch 3 is inside its transaction (records sent, marker not yet) when
    query 2 takes the sink id over (its claim resets the markers); query 1's task then commits.
    Query 2's batch 3 must still be written (its marker read must not find query 1's batch)."""
    topic = unique_name.replace("_", "-")
    config = kafka_sink(kafka.bootstrap_servers, topic, "transactional", partitions=1)
    sink = config.build(str(tmp_path))
    sink.preflight()
    sink.act_for(sink.take_epoch(0))
    sink.claim(SinkOwner("query-1", str(tmp_path / "retired")))

    def values(*items: str) -> Iterator[pa.RecordBatch]:
        yield pa.record_batch([pa.array(list(items)).cast(pa.binary())], names=["value"])

    takeover = config.build(str(tmp_path))

    def q2_takes_the_sink_over() -> None:
        takeover.act_for(takeover.take_epoch(sink.epoch))
        takeover.claim(SinkOwner("query-2", str(tmp_path / "fresh")))

    original = sink.markers.produce
    sink.markers.produce = frozen_at(original, 1, q2_takes_the_sink_over)  # type: ignore[method-assign]
    try:
        sink.write_partition(TaskInfo(sink.sink_id, 3, 0, 0, epoch=sink.epoch), values("q1-a", "q1-b"))
    except OncekitError:
        pass  # fenced by the takeover
    takeover.write_partition(TaskInfo(takeover.sink_id, 3, 0, 0, epoch=takeover.epoch), values("q2-a", "q2-b"))
    got = collections.Counter(v.decode() for v in read_committed(kafka, topic, 2, timeout_s=30))
    assert got == collections.Counter(["q2-a", "q2-b"])


def journaled_batch_0(postgres_dsn: str, unique_name: str, tmp_path: Path) -> Any:
    """The write-ahead-log run "old" on a new table: it journaled batch 0 (ids 1 and 2), which
    Spark logged as committed; nothing is published yet."""
    table(postgres_dsn, unique_name)
    spark_logged(tmp_path, planned=[0], committed=[])
    old = run(postgres_dsn, unique_name, tmp_path, "write-ahead-log", "old")
    old.checkpoint(0, old.write_task(TaskInfo(old.sink.sink_id, 0, 0, 0, epoch=old.epoch), iter([rows([1, 2])])))
    spark_logged(tmp_path, planned=[0], committed=[0])
    return old


def test_a_superseded_drivers_own_commit_of_completed_checkpoints_is_fenced(
    postgres_dsn: str, unique_name: str, tmp_path: Path,
) -> None:
    """The old driver (write-ahead log) journaled batch 0 and Spark logged it; a newer run took
    the sink over. The old driver, waking in its stop or in ``OncekitQuery.complete``, commits
    the completed checkpoints it knows: the target must refuse it (it acts for its run's epoch,
    never for none), and the newer run publishes the batch once."""
    from oncekit.core.spark.query import OncekitQuery

    journaled_batch_0(postgres_dsn, unique_name, tmp_path)
    new = run(postgres_dsn, unique_name, tmp_path, "write-ahead-log", "new", start=False)

    def frozen(*args: Any) -> Any:
        raise OncekitError("the newer run's publish froze (the test)")

    new.sink.send_values = frozen  # type: ignore[attr-defined, method-assign]
    try:
        new.start_run("new")
    except OncekitError:
        pass
    config = postgres_sink(postgres_dsn, unique_name, "write-ahead-log", columns=("id", "payload"))
    with pytest.raises(FencedError):
        OncekitQuery(object(), config, str(tmp_path), run="old").complete()  # type: ignore[arg-type]
    assert table_ids(postgres_dsn, unique_name) == collections.Counter()


# -- finding 5: the idempotent sink has no fencing -------------------------------------------

def test_a_stale_idempotent_task_never_puts_an_older_value_back(
    postgres_dsn: str, unique_name: str, tmp_path: Path,
) -> None:
    """The old run's task of batch 0 (id 1 = 'old') was paused; the newer run wrote batch 1
    (id 1 = 'new'); the old task wakes and upserts. The value must stay 'new'."""
    table(postgres_dsn, unique_name, keyed=True)
    spark_logged(tmp_path, planned=[0, 1], committed=[])
    old = run(postgres_dsn, unique_name, tmp_path, "idempotent", "old", key_columns=("id",))
    new = run(postgres_dsn, unique_name, tmp_path, "idempotent", "new", key_columns=("id",))
    sink_id = new.sink.sink_id
    batch = pa.record_batch([pa.array([1], pa.int32()), pa.array(["new"])], names=["id", "payload"])
    new.write_task(TaskInfo(sink_id, 1, 0, 0, epoch=new.epoch), iter([batch]))
    stale = pa.record_batch([pa.array([1], pa.int32()), pa.array(["old"])], names=["id", "payload"])
    with pytest.raises(FencedError):
        old.write_task(TaskInfo(sink_id, 0, 0, 0, epoch=old.epoch), iter([stale]))
    with psycopg.connect(postgres_dsn) as conn:
        assert conn.execute(f"SELECT payload FROM {unique_name} WHERE id = 1").fetchone() == ("new",)


# -- finding 6: a frozen driver's lock blocks takeover ---------------------------------------

TAKEOVER_BOUND_S = 40.0
"""What a test accepts for a takeover past a frozen holder's lock: the kit's bound on a frozen
session of the driver (PostgreSQL ends it) plus margin for a loaded machine."""


def test_a_driver_frozen_inside_its_publish_does_not_hold_the_next_run_off(
    postgres_dsn: str, unique_name: str, tmp_path: Path,
) -> None:
    """The old run publishes batch 0 (write-ahead log) and its host freezes mid-publish, its
    transaction open; the next run's start must take its epoch within the stated bound, and the
    old publish, when it thaws, must not commit."""
    old = journaled_batch_0(postgres_dsn, unique_name, tmp_path)
    thaw, frozen = threading.Event(), threading.Event()
    fence = old.sink.target.fence  # type: ignore[attr-defined]  # after the publish wrote its rows

    def freeze(*args: Any, **kwargs: Any) -> Any:
        frozen.set()
        thaw.wait(TAKEOVER_BOUND_S * 3)
        return fence(*args, **kwargs)

    old.sink.target.fence = freeze  # type: ignore[attr-defined]
    outcome: list[BaseException | None] = []

    def publish() -> None:
        try:
            old.complete()
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome.append(exc)

    publisher = threading.Thread(target=publish, daemon=True)
    publisher.start()
    assert frozen.wait(30)
    new = run(postgres_dsn, unique_name, tmp_path, "write-ahead-log", "new", start=False)
    started: list[float] = []
    taker = threading.Thread(target=lambda: (new.start_run("new"), started.append(time.monotonic())), daemon=True)
    began = time.monotonic()
    taker.start()
    taker.join(TAKEOVER_BOUND_S)
    thaw.set()
    publisher.join(60)
    assert started, f"the next run's start waited more than {TAKEOVER_BOUND_S:.0f} s on the frozen driver's lock"
    new.complete()
    assert table_ids(postgres_dsn, unique_name) == collections.Counter([1, 2])
    assert started[0] - began < TAKEOVER_BOUND_S


def test_a_task_frozen_before_its_prepare_does_not_hold_the_replay_off(
    postgres_dsn: str, unique_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A task of the old run froze inside its transaction (its rows written, so their keys
    locked; PREPARE not yet sent); the newer run replays the batch: its task for the same partition must get through
    within the stated bound of a frozen task's session, and the batch is committed once."""
    monkeypatch.setenv("ONCEKIT_TASK_SESSION_IDLE_S", "5")
    table(postgres_dsn, unique_name, keyed=True)
    spark_logged(tmp_path, planned=[0], committed=[])
    old = run(postgres_dsn, unique_name, tmp_path, "two-phase-commit", "old", key_columns=("id",))
    sink_id = old.sink.sink_id
    thaw, frozen = threading.Event(), threading.Event()
    fence = old.sink.target.fence  # type: ignore[attr-defined]  # after the task wrote its rows

    def freeze(*args: Any, **kwargs: Any) -> Any:
        frozen.set()
        thaw.wait(120)
        return fence(*args, **kwargs)

    old.sink.target.fence = freeze  # type: ignore[attr-defined]
    stale = threading.Thread(target=lambda: _swallow(lambda: old.write_task(
        TaskInfo(sink_id, 0, 0, 0, epoch=old.epoch), iter([rows([1, 2])]))), daemon=True)
    stale.start()
    assert frozen.wait(30)
    new = run(postgres_dsn, unique_name, tmp_path, "two-phase-commit", "new", key_columns=("id",))
    began = time.monotonic()
    replayed: list[Any] = []
    while not replayed and time.monotonic() - began < TAKEOVER_BOUND_S:
        try:
            replayed = new.write_task(TaskInfo(sink_id, 0, 0, 1, epoch=new.epoch), iter([rows([1, 2])]))
        except OncekitError:
            time.sleep(0.5)  # Spark's retry of the task
    thaw.set()
    stale.join(60)
    assert replayed, f"the replayed task waited more than {TAKEOVER_BOUND_S:.0f} s on the frozen task's locks"
    new.checkpoint(0, replayed)
    spark_logged(tmp_path, planned=[0], committed=[0])
    new.complete()
    assert table_ids(postgres_dsn, unique_name) == collections.Counter([1, 2])
    assert prepared(postgres_dsn, sink_id) == []


def _swallow(call: Callable[[], Any]) -> None:
    try:
        call()
    except BaseException:  # noqa: BLE001 - a frozen run's late failure is expected
        pass


# -- found by the simulation: a driver whose Spark read the checkpoint before a takeover -------

@pytest.mark.parametrize("partition", [0, 1])
def test_a_driver_whose_spark_is_behind_never_writes_an_older_idempotent_batch_over_a_newer_one(
    postgres_dsn: str, unique_name: str, tmp_path: Path, partition: int,
) -> None:
    """Driver B's Spark planned batch 0 and B paused before its first writer; driver A took over
    and wrote batches 0 to 2, each in one task. B wakes, takes the newest epoch (its first writer
    comes now) and runs the batch 0 its Spark planned: its rows of batch 0 must not overwrite
    batch 2's, whether its task is the partition A wrote or one A's plan did not have (found by
    the simulation once runs plan their batches in different task counts)."""
    table(postgres_dsn, unique_name, keyed=True)
    spark_logged(tmp_path, planned=[0, 1, 2], committed=[0, 1, 2])
    a = run(postgres_dsn, unique_name, tmp_path, "idempotent", "a", key_columns=("id",))
    sink_id = a.sink.sink_id
    for batch in (0, 1, 2):
        a.write_task(TaskInfo(sink_id, batch, 0, batch, epoch=a.epoch), iter([pa.record_batch(
            [pa.array([1], pa.int32()), pa.array([f"batch {batch}"])], names=["id", "payload"])]))
    b = run(postgres_dsn, unique_name, tmp_path, "idempotent", "b", key_columns=("id",))
    with pytest.raises(OncekitError, match="rows of a later batch"):
        b.write_task(TaskInfo(sink_id, 0, partition, 0, epoch=b.epoch), iter([pa.record_batch(
            [pa.array([1], pa.int32()), pa.array(["batch 0"])], names=["id", "payload"])]))
    with psycopg.connect(postgres_dsn) as conn:
        assert conn.execute(f"SELECT payload FROM {unique_name} WHERE id = 1").fetchone() == ("batch 2",)

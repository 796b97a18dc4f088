"""The server-side committer's decisions (core/spark/committer.py), on a checkpoint folder laid
out as Spark lays it out and the in-memory sink of test_engine; the real proof is in
tests/eos/test_connect.py."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from oncekit.core.engine import CheckpointEngine
from oncekit.core.spark import committer
from tests.unit.test_engine import MemorySink, prepare, spark_logged


@pytest.fixture
def engine(tmp_path: Path) -> CheckpointEngine:
    engine = CheckpointEngine(MemorySink(), str(tmp_path))
    engine.start_run("run-1")
    return engine


def sink_of(engine: CheckpointEngine) -> MemorySink:
    assert isinstance(engine.sink, MemorySink)
    return engine.sink


def server_committed(engine: CheckpointEngine) -> list[str]:
    return sink_of(engine).server.committed


@pytest.fixture
def inbox() -> Iterator[tuple[socket.socket, socket.socket]]:
    receiver, sender = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.settimeout(0.2)
    with receiver, sender:
        yield receiver, sender


def test_batch_0_is_committed_once_spark_logs_it_not_after_the_wait(
        engine: CheckpointEngine, tmp_path: Path, inbox: tuple[socket.socket, socket.socket],
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Batch 0 is a batch like any other (its id is falsy: the committer once read 'the newest
    completed batch is 0' as 'none', waited out its 30 s and committed batch 0 at a sweep)."""
    monkeypatch.setattr(committer, "COMMIT_LOG_WAIT_S", 0.5)
    engine.checkpoint(0, [prepare(engine, 0, 0)], notified=True)
    spark_logged(tmp_path, "commits", 0)
    with caplog.at_level(logging.WARNING):
        committer.Committer(engine, "run-1", inbox[0])._commit(0)
    assert server_committed(engine) == ["oncekit:memory:0:0:0:e1"]
    assert "did not log the batch complete" not in caplog.text


def test_wake_ups_commit_each_completed_batch_and_a_newer_run_ends_the_committer(
        engine: CheckpointEngine, tmp_path: Path, inbox: tuple[socket.socket, socket.socket]) -> None:
    receiver, sender = inbox
    served = threading.Thread(target=committer.Committer(engine, "run-1", receiver).serve, args=(None,))
    served.start()
    try:
        for batch_id in (0, 1):
            engine.checkpoint(batch_id, [prepare(engine, batch_id, 0)], notified=True)
            spark_logged(tmp_path, "commits", batch_id)
            sender.send(str(batch_id).encode())
        deadline = time.monotonic() + 10
        while len(server_committed(engine)) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        engine.checkpoint(2, [prepare(engine, 2, 0)], notified=True)  # journaled, not logged by Spark
        engine.journal.record_epoch("run-2", 2)  # a newer run started
        sender.send(b"2")
        served.join(10)
        assert not served.is_alive(), "the committer of run-1 went on after run-2 started"
    finally:
        engine.journal.record_epoch("stop", 3)
        served.join(10)
    assert server_committed(engine) == ["oncekit:memory:0:0:0:e1", "oncekit:memory:1:0:0:e1"]


def test_a_committer_busy_with_a_slow_target_never_blocks_the_driver_side_commit(
        engine: CheckpointEngine, tmp_path: Path) -> None:
    """Issue 36, finding 1: while the committer is inside a long commit (a target down, a lock
    held), every batch's driver-side commit wakes it. The wake-up must not wait for the
    committer once its socket queue is full (about ten datagrams): a write-ahead-log sink keeps
    ingesting, and the committer's next sweep commits what completed."""
    config = engine.sink  # only its sink_id is read
    path, _ = committer._paths(str(tmp_path), config.sink_id, "run-1")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as busy:  # bound, never read: the committer is busy
        busy.bind(path)
        woken = threading.Event()

        def wake_up_every_batch() -> None:
            for batch_id in range(100):
                committer.wake(config, str(tmp_path), "run-1", batch_id)  # type: ignore[arg-type]
            woken.set()

        threading.Thread(target=wake_up_every_batch, daemon=True).start()
        try:
            assert woken.wait(10), "a wake-up waited for the busy committer"
        finally:
            import os
            os.unlink(path)


def test_the_committer_takes_the_newest_queued_wake_up_without_waiting_for_another(engine: CheckpointEngine) -> None:
    """Found by the clean-clone run (test_connect: batches 1-19 committed a trigger late): the
    wake-ups queued behind the one received are read without waiting; on the committer's socket,
    whose timeout is the sweep interval, a read flagged MSG_DONTWAIT still waited that long for
    one more datagram, then raised TimeoutError, which dropped the batch id."""
    receiver, sender = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.settimeout(committer.SWEEP_S)
    with receiver, sender:
        for batch_id in (1, 2, 3):
            sender.send(str(batch_id).encode())
        served = committer.Committer(engine, "run-1", receiver)
        started = time.monotonic()
        assert served._newest(int(receiver.recv(32))) == 3
        assert time.monotonic() - started < committer.SWEEP_S
        assert receiver.gettimeout() == committer.SWEEP_S  # the sweep interval is kept

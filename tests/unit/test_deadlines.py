"""The kit's own deadlines: a call that ignores its timeout ends in a named StallError, and the
batch timeout a query gets."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from oncekit.core.deadline import bounded
from oncekit.core.errors import ConfigError, QueryStuckError, StallError
from oncekit.core.restart import restartable
from oncekit.core.spark.query import BATCH_TIMEOUT_CONF, Trigger, batch_timeout_s
from oncekit.core.stalls import StallLog


def test_bounded_call_that_never_returns_raises_stall_error_naming_the_step() -> None:
    never = threading.Event()
    started = time.monotonic()
    with pytest.raises(StallError, match=r"sink s batch 3 partition 1: commit_transaction waited 0 s"):
        bounded("sink s batch 3 partition 1: commit_transaction", 0.2, never.wait)
    assert time.monotonic() - started < 2
    never.set()


def test_bounded_call_returns_its_result_or_raises_its_error() -> None:
    assert bounded("x", 5, lambda a: a + 1, 1) == 2
    with pytest.raises(ZeroDivisionError):
        bounded("x", 5, lambda: 1 / 0)


class _Session:
    def __init__(self, **conf: str) -> None:
        self.conf = self
        self._conf = conf

    def get(self, key: str, default: Any = None) -> Any:
        return self._conf.get(key, default)


def test_batch_timeout_default_is_five_minutes_or_ten_triggers_whichever_is_longer() -> None:
    assert batch_timeout_s(_Session(), Trigger(processing_time="1 second"), None) == 300  # type: ignore[arg-type]
    assert batch_timeout_s(_Session(), Trigger(processing_time="1 minute"), None) == 600  # type: ignore[arg-type]
    assert batch_timeout_s(_Session(), Trigger(available_now=True), None) == 300  # type: ignore[arg-type]
    assert batch_timeout_s(_Session(**{BATCH_TIMEOUT_CONF: "90"}), None, None) == 90  # type: ignore[arg-type]
    assert batch_timeout_s(_Session(**{BATCH_TIMEOUT_CONF: "90"}), None, 30) == 30  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=BATCH_TIMEOUT_CONF):
        batch_timeout_s(_Session(**{BATCH_TIMEOUT_CONF: "5 minutes"}), None, None)  # type: ignore[arg-type]


def test_stall_restarts_the_query_but_a_stuck_query_stops_the_driver() -> None:
    assert restartable(StallError("query q batch 3: planned and not committed"))
    assert not restartable(QueryStuckError("query q: did not stop"))


def test_stall_log_counts_every_stall_and_keeps_the_recent_ones(tmp_path: Any) -> None:
    log = StallLog(str(tmp_path))
    assert log.read() == (0, [])
    for batch in range(25):
        log.record(batch, 91.0, f"batch {batch}")
    total, recent = log.read()
    assert total == 25 and len(recent) == 20 and recent[0].batch == 24


def test_speculation_is_refused_at_start() -> None:
    from oncekit.core.spark.query import refuse_speculation
    from oncekit.sinks.kafka import kafka_sink

    sink = kafka_sink("b:1", "t")
    refuse_speculation(_Session(), sink)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"sink kafka-t: spark.speculation=true .* set spark.speculation=false"):
        refuse_speculation(_Session(**{"spark.speculation": "true"}), sink)  # type: ignore[arg-type]


def test_mirroring_offsets_to_a_consumer_group_never_blocks_the_driver_on_a_silent_broker() -> None:
    """Issue 36, finding 2: the source mirrors committed offsets to ``consumerGroup`` between
    batches, on the driver, where nothing bounds a wait. Against a broker that accepts the
    connection and never answers (a paused or partitioned one), the mirror must return at
    once; it waited on the group coordinator before (librdkafka's synchronous commit)."""
    import socket
    import threading

    from oncekit.sources._spark_kafka import KafkaStreamReader
    from oncekit.sources.kafka import KafkaSourceOptions

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)  # the kernel accepts; nobody ever answers
    options = KafkaSourceOptions.parse({"kafka.bootstrap.servers": f"127.0.0.1:{silent.getsockname()[1]}",
                                        "subscribe": "t", "consumerGroup": "mirror"})
    reader = KafkaStreamReader(options)
    returned = threading.Event()
    threading.Thread(target=lambda: (reader.commit({"t": {"0": 5, "1": 7}}), returned.set()), daemon=True).start()
    try:
        assert returned.wait(15), "the offsets mirror blocked the driver on a broker that does not answer"
    finally:
        silent.close()


def test_a_worker_holding_too_many_stuck_calls_exits_at_its_next_task(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 36, finding 3: every call that outlived its deadline keeps a thread (and the client
    it used) in a Python worker Spark reuses. They are counted while they hang; at the cap the
    worker exits at its next task's start, before writing anything, so Spark replaces it."""
    import threading

    from oncekit.core import deadline
    from oncekit.core.errors import StallError

    base = deadline.stuck_calls()  # other tests' calls, if any
    monkeypatch.setattr(deadline, "STUCK_CAP", base + 3)
    release = threading.Event()
    for _ in range(2):
        with pytest.raises(StallError):
            deadline.bounded("sink s batch 1 partition 0: commit", 0.01, release.wait)
    assert deadline.stuck_calls() == base + 2
    exits: list[int] = []
    monkeypatch.setattr(deadline.os, "_exit", exits.append)
    deadline.exit_if_stuck("sink s batch 2 partition 0")
    assert exits == []
    with pytest.raises(StallError, match="exits at its next task"):
        deadline.bounded("sink s batch 1 partition 1: commit", 0.01, release.wait)
    deadline.exit_if_stuck("sink s batch 2 partition 0")
    assert exits == [deadline.STUCK_EXIT_CODE]
    release.set()  # the calls return at last; they no longer count
    for _ in range(100):
        if deadline.stuck_calls() <= base:
            break
        time.sleep(0.01)
    assert deadline.stuck_calls() <= base


def test_a_trigger_that_plans_no_batch_for_longer_than_the_batch_timeout_is_a_stall(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 36, finding 2: Spark's trigger runs, asking the source for offsets, and no batch
    gets planned (a source call that hangs between batches: planned == completed, so no batch
    is overdue). The watchdog must see it as a stall naming the query and the step, and stop
    the query for its restart strategy."""
    from oncekit.core.spark import watchdog as queries
    from oncekit.core.spark.watchdog import BatchWatchdog

    monkeypatch.setattr(queries, "PLANNING_FLOOR_S", 0.5)

    for folder in ("offsets", "commits"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "0").write_text("v1")

    class PlanningForEver:
        isActive = True
        status = {"message": "Getting offsets from oncekit-kafka", "isDataAvailable": False, "isTriggerActive": True}
        lastProgress = None  # noqa: N815  (Spark's name)

        def stop(self) -> None:
            self.isActive = False

        def exception(self) -> None:
            return None

    query: Any = PlanningForEver()
    watchdog = BatchWatchdog(query, str(tmp_path), "q", timeout_s=1.0, run="run").start()
    try:
        deadline = time.monotonic() + 20
        while watchdog.stall is None and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        watchdog.close()
    assert isinstance(watchdog.stall, StallError), "the watchdog let a trigger plan nothing for ever"
    assert "query q" in str(watchdog.stall) and "Getting offsets from oncekit-kafka" in str(watchdog.stall)
    assert not query.isActive


def test_a_trigger_is_spark_s_keywords_checked_when_made() -> None:
    assert Trigger(processing_time="10 seconds").keywords() == {"processingTime": "10 seconds"}
    assert Trigger(available_now=True).keywords() == {"availableNow": True}
    assert Trigger().keywords() == {}
    with pytest.raises(ConfigError, match="give processing_time or available_now, not both"):
        Trigger(processing_time="1 second", available_now=True)
    with pytest.raises(ConfigError, match=r"processing_time '5 secs please' is not an interval Spark reads"):
        Trigger(processing_time="5 secs please")

"""The status page's figures and metrics on a fixture checkpoint: Spark's offset and commit logs
and the kit's journal written as Spark and the engine write them, with chosen file times, and
fake services. One assertion per metric's value."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from oncekit.connectors.postgres import PreparedTransaction
from oncekit.core.journal import Journal
from oncekit.core.names import StagedFile, TransactionId
from oncekit.core.protocol import Committable
from oncekit.status import kafka_transactions, metrics
from oncekit.status.collector import StatusCollector, Watched
from oncekit.status.kafka_transactions import KafkaTransaction
from oncekit.status.snapshot import CommitMode, Snapshot, Thresholds

T0 = 1_700_000_000.0
NOW = T0 + 100.0
FANOUT, BALANCES, UPDATES = "fanout-abc", "pg-balances", "kafka-updates"
SECRET = "hunter2secret"


def _write(path: Path, text: str, mtime: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    os.utime(path, (mtime, mtime))


def end_of(batch_id: int) -> dict[str, int]:
    """Batch N ends at offset 100 (N+1) in partition 0 and 50 (N+1) in partition 1: 150 records a batch."""
    return {"0": 100 * (batch_id + 1), "1": 50 * (batch_id + 1)}


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    """Batches 0-4 planned (every 10 s from T0), 0-3 complete (2 s each), all five journaled by the
    fan-out sink, 0-2 committed 0.5 s after their checkpoint completed: batch 3 completed but not
    committed, batch 4 running."""
    root = tmp_path / "pipeline"
    journal = Journal(str(root), FANOUT)
    for batch in range(5):
        start = T0 + 10 * batch
        meta = json.dumps({"batchWatermarkMs": 0, "batchTimestampMs": int(start * 1000), "conf": {}})
        _write(root / "offsets" / str(batch), f"v1\n{meta}\n{json.dumps({'payments': end_of(batch)})}", start)
        gid = str(TransactionId(BALANCES, batch, 0, 10 + batch))
        journal.write(batch, [Committable(BALANCES, batch, 0, 10 + batch, 7, transaction_id=gid),
                              Committable(UPDATES, batch, 0, 10 + batch, 7)])
        os.utime(root / "oncekit" / FANOUT / "journal" / f"{batch}.json", (start + 1.5, start + 1.5))
        if batch <= 3:
            _write(root / "commits" / str(batch), 'v1\n{"nextBatchWatermarkMs":0}', start + 2)
        if batch <= 2:
            journal.mark_done(batch)
            os.utime(root / "oncekit" / FANOUT / "journal" / f"{batch}.done", (start + 2.5, start + 2.5))
    for name in ("lease", "plan"):  # what start_query keeps beside the journals (files, not sink folders)
        (root / "oncekit" / name).write_text("{}")
    return root


def fake_services(end: dict[tuple[str, int], tuple[int | None, int | None]] | None = None) -> dict[str, Any]:
    prepared = [
        PreparedTransaction(str(TransactionId(BALANCES, 4, 0, 14)), 5.0, "oncekit", 3, ("balances",)),
        PreparedTransaction(str(TransactionId("pg-other", 9, 1, 1)), 120.0, "oncekit", 1, ("other",)),
    ]
    open_transactions = [KafkaTransaction("someone-else-0", 7, "Ongoing", 60_000, 90.0, ("updates-0",))]
    offsets = end or {("payments", 0): (600, 590), ("payments", 1): (260, 260)}
    return {"end_offsets": lambda wanted: offsets, "prepared": lambda: prepared,
            "kafka_transactions": lambda: open_transactions}


def collector(checkpoint: Path, thresholds: Thresholds | None = None, **services: Any) -> StatusCollector:
    return StatusCollector([Watched("pipeline", str(checkpoint), {FANOUT: "fan-out", BALANCES: "two-phase-commit",
                                                                  UPDATES: "transactional"})],
                           thresholds, clock=lambda: NOW, **(services or fake_services()))


def value(snapshot: Snapshot, name: str, **labels: str) -> float | None:
    return metrics.registry(lambda: snapshot).get_sample_value(name, labels)


@pytest.fixture
def snapshot(checkpoint: Path) -> Snapshot:
    found = collector(checkpoint)
    found.record_restart("*", RuntimeError("query pipeline failed: a task's Python worker died\nstack..."))
    return found.collect()


def test_status_last_planned_batch_is_newest_offset_log_entry(snapshot: Snapshot) -> None:
    assert value(snapshot, "oncekit_last_planned_batch", query="pipeline") == 4


def test_status_last_completed_batch_is_newest_commit_log_entry(snapshot: Snapshot) -> None:
    assert value(snapshot, "oncekit_last_completed_batch", query="pipeline") == 3


def test_status_completed_batches_counts_commit_log(snapshot: Snapshot) -> None:
    assert value(snapshot, "oncekit_completed_batches", query="pipeline") == 4


def test_status_checkpoint_duration_is_offsets_to_commits(snapshot: Snapshot) -> None:
    assert value(snapshot, "oncekit_checkpoint_duration_seconds", query="pipeline") == pytest.approx(2.0)


def test_status_batch_records_is_offset_difference(snapshot: Snapshot) -> None:
    assert value(snapshot, "oncekit_batch_records", query="pipeline") == 150


def test_status_commit_latency_is_commits_to_done(snapshot: Snapshot) -> None:
    assert value(snapshot, "oncekit_commit_latency_seconds", query="pipeline", sink=FANOUT) == pytest.approx(0.5)


def test_status_commit_lag_counts_completed_uncommitted_batches(snapshot: Snapshot) -> None:
    assert value(snapshot, "oncekit_commit_lag_batches", query="pipeline", sink=FANOUT) == 1


def test_status_uncommitted_batches_counts_journaled_not_done(snapshot: Snapshot) -> None:
    assert value(snapshot, "oncekit_uncommitted_batches", query="pipeline", sink=FANOUT) == 2


def test_status_oldest_uncommitted_age_from_journal_entry(snapshot: Snapshot) -> None:
    age = value(snapshot, "oncekit_oldest_uncommitted_batch_age_seconds", query="pipeline", sink=FANOUT)
    assert age == pytest.approx(NOW - (T0 + 31.5))


def test_status_committed_batches_counts_done_entries(snapshot: Snapshot) -> None:
    assert value(snapshot, "oncekit_committed_batches", query="pipeline", sink=FANOUT) == 3


def test_status_source_offsets_per_partition(snapshot: Snapshot) -> None:
    labels = {"query": "pipeline", "topic": "payments", "partition": "0"}
    assert value(snapshot, "oncekit_source_end_offset", **labels) == 600
    assert value(snapshot, "oncekit_source_stable_offset", **labels) == 590
    assert value(snapshot, "oncekit_source_planned_offset", **labels) == 500
    assert value(snapshot, "oncekit_source_completed_offset", **labels) == 400


def test_status_source_lag_is_end_minus_completed(snapshot: Snapshot) -> None:
    assert value(snapshot, "oncekit_source_lag_records", query="pipeline", topic="payments", partition="0") == 200
    assert value(snapshot, "oncekit_source_lag_records", query="pipeline", topic="payments", partition="1") == 60


def test_status_prepared_transactions_per_sink(snapshot: Snapshot) -> None:
    assert value(snapshot, "oncekit_prepared_transactions", sink=BALANCES) == 1
    assert value(snapshot, "oncekit_prepared_transactions", sink="pg-other") == 1


def test_status_prepared_transaction_oldest_age(snapshot: Snapshot) -> None:
    assert value(snapshot, "oncekit_prepared_transaction_oldest_age_seconds") == 120.0


def test_status_prepared_transaction_locks(snapshot: Snapshot) -> None:
    assert value(snapshot, "oncekit_prepared_transaction_locks") == 4


def test_status_open_kafka_transactions(snapshot: Snapshot) -> None:
    assert value(snapshot, "oncekit_open_kafka_transactions") == 1
    assert value(snapshot, "oncekit_open_kafka_transaction_oldest_age_seconds") == 90.0


def test_status_restarts_counted_with_cause(snapshot: Snapshot) -> None:
    assert value(snapshot, "oncekit_restarts_total", query="pipeline") == 1
    assert snapshot.queries[0].restarts[0].cause == "query pipeline failed: a task's Python worker died"


def test_status_alerts_and_risk(snapshot: Snapshot) -> None:
    assert value(snapshot, "oncekit_alerts", kind="prepared_transaction_too_old") == 1
    assert value(snapshot, "oncekit_alerts", kind="kafka_transaction_too_old") == 1
    assert value(snapshot, "oncekit_alerts", kind="batch_not_committed") == 0
    assert value(snapshot, "oncekit_exactly_once_at_risk") == 1
    assert value(snapshot, "oncekit_status_source_up", source="postgres") == 1


def test_status_prepared_transaction_states(snapshot: Snapshot) -> None:
    by_sink = {t.sink_id: t for t in snapshot.prepared or ()}
    assert by_sink[BALANCES].query == "pipeline" and by_sink[BALANCES].batch_id == 4
    assert by_sink[BALANCES].state == "journaled, checkpoint not complete" and not by_sink[BALANCES].red
    assert by_sink["pg-other"].query is None and by_sink["pg-other"].red


def test_status_targets_with_protocols(snapshot: Snapshot) -> None:
    (sink,) = snapshot.queries[0].sinks
    assert sink.protocol == "fan-out"
    targets = {t.sink_id: t for t in sink.targets}
    assert targets[BALANCES].protocol == "two-phase-commit" and targets[BALANCES].committed_committables == 3
    assert targets[UPDATES].protocol == "transactional" and targets[UPDATES].committed_rows == 21


def fan_out_checkpoint(root: Path) -> None:
    """A fan-out with a two-phase-commit target that committed batch 0 and waits for batch 1, a
    write-ahead-log target whose only committable (batch 1) waits for its commit, and a second
    two-phase-commit target that got no rows: the last two have committed nothing yet."""
    journal = Journal(str(root), FANOUT)
    for batch in (0, 1):
        _write(root / "offsets" / str(batch), f"v1\n{{}}\n{json.dumps({'payments': end_of(batch)})}", T0 + 10 * batch)
        _write(root / "commits" / str(batch), 'v1\n{"nextBatchWatermarkMs":0}', T0 + 10 * batch + 2)
    journal.write(0, [Committable(BALANCES, 0, 0, 1, 5, transaction_id=str(TransactionId(BALANCES, 0, 0, 1)))])
    journal.mark_done(0)
    journal.write(1, [Committable(BALANCES, 1, 0, 2, 4, transaction_id=str(TransactionId(BALANCES, 1, 0, 2))),
                      Committable("kafka-staged", 1, 0, 2, 3, staged_file=str(StagedFile(1, 0, 2)))])


def test_status_fan_out_targets_commit_mode_follows_protocol_not_commits_seen(tmp_path: Path) -> None:
    fan_out_checkpoint(tmp_path / "cp")
    protocols = {FANOUT: "fan-out", BALANCES: "two-phase-commit", "kafka-staged": "write-ahead-log",
                 "pg-idle": "two-phase-commit", UPDATES: "transactional"}
    found = StatusCollector([Watched("pipeline", str(tmp_path / "cp"), protocols)], clock=lambda: NOW).collect()
    targets = {t.sink_id: t for t in found.queries[0].sinks[0].targets}
    assert {name: (t.protocol, t.commit_mode) for name, t in targets.items()} == {
        BALANCES: ("two-phase-commit", CommitMode.CHECKPOINT), "kafka-staged": ("write-ahead-log", CommitMode.CHECKPOINT),
        "pg-idle": ("two-phase-commit", CommitMode.CHECKPOINT), UPDATES: ("transactional", CommitMode.TASK)}
    assert (targets[BALANCES].committed_committables, targets[BALANCES].committed_rows) == (1, 5)
    assert targets["kafka-staged"].committed_committables == 0 and targets["pg-idle"].committed_committables == 0
    page = json.loads(json.dumps(found.to_json()))  # what /api/status sends
    shown = {t["sink_id"]: t["commit_mode"] for t in page["queries"][0]["sinks"][0]["targets"]}
    assert shown == {BALANCES: "checkpoint-complete", "kafka-staged": "checkpoint-complete",
                     "pg-idle": "checkpoint-complete", UPDATES: "task"}


def test_status_fan_out_target_protocol_unknown_is_read_from_waiting_committables(tmp_path: Path) -> None:
    fan_out_checkpoint(tmp_path / "cp")
    found = StatusCollector([Watched("pipeline", str(tmp_path / "cp"))], clock=lambda: NOW).collect()
    (sink,) = found.queries[0].sinks
    assert sink.protocol == "fan-out"
    assert [(t.sink_id, t.protocol, t.commit_mode) for t in sink.targets] == [
        ("kafka-staged", "write-ahead-log", CommitMode.CHECKPOINT), (BALANCES, "two-phase-commit", CommitMode.CHECKPOINT)]


def test_status_commit_mode_of_every_protocol() -> None:
    assert [CommitMode.of(p) for p in ("two-phase-commit", "write-ahead-log", "transactional", "idempotent",
                                       "at-least-once", "fan-out")] == [
        CommitMode.CHECKPOINT, CommitMode.CHECKPOINT, CommitMode.TASK, CommitMode.TASK, CommitMode.TASK, CommitMode.UNKNOWN]


def test_status_batch_not_committed_after_n_triggers_is_red(checkpoint: Path) -> None:
    found = collector(checkpoint, Thresholds(uncommitted_triggers=1)).collect()
    assert value(found, "oncekit_alerts", kind="batch_not_committed") == 1
    assert [p.batch_id for p in found.queries[0].sinks[0].pending if p.red] == [3]


def test_status_lag_growing_is_red_after_growing_samples(checkpoint: Path) -> None:
    ends = iter([100, 200, 300, 300])
    services = fake_services()
    services["end_offsets"] = lambda wanted: {("payments", 0): (600 + next(ends), None), ("payments", 1): (260, None)}
    found = collector(checkpoint, Thresholds(lag_growth_samples=3, lag_sample_interval_s=0), **services)
    assert [found.collect().queries[0].lag_growing for _ in range(3)] == [False, False, True]
    assert value(found.collect(), "oncekit_source_lag_growing", query="pipeline") == 0  # the end stopped growing


def test_status_service_errors_never_show_the_password(checkpoint: Path) -> None:
    def refuse() -> list[PreparedTransaction]:
        raise RuntimeError(f"connection to postgresql://oncekit:{SECRET}@127.0.0.1:5432/db refused")

    services = fake_services()
    services["prepared"] = refuse
    found = collector(checkpoint, **services).collect()
    assert found.prepared is None and "postgres" in found.errors
    assert SECRET not in json.dumps(found.to_json())
    assert value(found, "oncekit_status_source_up", source="postgres") == 0


def test_status_unreadable_checkpoint_is_shown_not_raised(tmp_path: Path) -> None:
    (tmp_path / "broken" / "offsets").mkdir(parents=True)
    (tmp_path / "broken" / "offsets" / "0").write_text("v1\n{}\nnot json either")
    found = StatusCollector([Watched("broken", str(tmp_path / "broken"))], clock=lambda: NOW).collect()
    assert found.queries[0].last_planned == 0 and found.queries[0].partitions == ()


def test_status_server_serves_page_data_metrics_and_uplot(checkpoint: Path) -> None:
    from urllib.request import urlopen

    from oncekit.status.app import StatusServer, StatusService

    with StatusServer(StatusService(collector(checkpoint), refresh_s=60), port=0) as server:
        def get(path: str) -> str:
            with urlopen(server.url + path, timeout=10) as response:
                return str(response.read().decode())

        assert "uPlot" in get("")
        assert json.loads(get("api/status"))["queries"][0]["last_completed"] == 3
        assert 'oncekit_commit_lag_batches{query="pipeline",sink="fanout-abc"} 1.0' in get("metrics")
        assert "uPlot" in get("static/uplot/uPlot.iife.min.js")
        assert "refresh" in get("static/status.js")


def test_transactions_command_tables_parsed() -> None:
    listed = kafka_transactions._table(
        "TransactionalId     \tCoordinator\tProducerId\tTransactionState \n"
        "oncekit-kafka-out-0 \t1          \t3         \tOngoing          \n"
        "oncekit-probe-1     \t1          \t4         \tEmpty            \n")
    assert [(r["TransactionalId"], r["TransactionState"]) for r in listed] == [
        ("oncekit-kafka-out-0", "Ongoing"), ("oncekit-probe-1", "Empty")]
    described = kafka_transactions._table(
        "CoordinatorId\tTransactionalId\tProducerId\tProducerEpoch\tTransactionState\tTransactionTimeoutMs\t"
        "CurrentTransactionStartTimeMs\tTransactionDurationMs\tTopicPartitions\n"
        "1\toncekit-kafka-out-0\t3\t0\tOngoing\t60000\t1700000000000\t4200\tout-0,out-1\n")
    assert described[0]["TopicPartitions"] == "out-0,out-1" and described[0]["TransactionDurationMs"] == "4200"


def test_status_checkpoint_flags_name_each_query() -> None:
    from oncekit.status.command import watched_from_flags

    named, plain, remote = watched_from_flags(["balances=/cp/a", "/cp/pipeline/", "s3a://bucket/cp/q1"])
    assert (named.name, named.checkpoint) == ("balances", "/cp/a")
    assert (plain.name, plain.checkpoint) == ("pipeline", "/cp/pipeline")
    assert (remote.name, remote.checkpoint) == ("q1", "s3a://bucket/cp/q1")


def test_status_protocols_of_fan_out_name_every_target() -> None:
    from oncekit.core.fanout import fan_out
    from oncekit.sinks.kafka import kafka_sink
    from oncekit.sinks.postgres import postgres_sink
    from oncekit.status.command import protocols_of

    sink = fan_out({"t": postgres_sink(f"postgresql://u:{SECRET}@h/db", "tbl", "two-phase-commit"),
                    "k": kafka_sink("h:9092", "out", "transactional")})
    assert protocols_of(sink) == {sink.sink_id: "fan-out", "pg-tbl": "two-phase-commit", "kafka-out": "transactional"}


def test_status_aborted_batches_seen_between_refreshes(checkpoint: Path) -> None:
    found = collector(checkpoint)
    found.collect()
    journal = Journal(str(checkpoint), FANOUT)
    journal.delete(4)  # recovery: batch 4's checkpoint never completed
    journal.mark_done(3)  # batch 3 committed: not an abort
    after = found.collect()
    assert value(after, "oncekit_aborted_batches_total", query="pipeline", sink=FANOUT) == 1
    assert [(a.batch_id, a.how) for a in after.queries[0].sinks[0].aborted] == [
        (4, "journal entry removed: checkpoint never completed")]
    journal.write(4, [])  # the re-run journals it again: no new abort
    assert value(found.collect(), "oncekit_aborted_batches_total", query="pipeline", sink=FANOUT) == 1

"""``/metrics``: the status page's figures in Prometheus' text format, through prometheus_client.

:class:`SnapshotMetrics` is a custom collector: each scrape turns the latest
:class:`~oncekit.status.snapshot.Snapshot` into metric families, so the numbers on the page and
the scraped ones are the same. Every metric is a gauge (a value read from the checkpoint or a
service at the snapshot's time) except ``oncekit_restarts_total``, ``oncekit_aborted_batches_total`` and
``oncekit_stalled_batches_total``; :data:`METRICS` lists them
with their help text, which docs/operations.md repeats. Labels: ``query`` (the checkpoint's name),
``sink`` (a journal's sink id, or a fan-out target's), ``topic`` and ``partition``.

Exactly-once is at risk when ``oncekit_exactly_once_at_risk`` is 1: a prepared or open
transaction older than the transaction timeout, or a batch whose checkpoint completed but whose
commit has not reached the target after ``uncommitted_triggers`` batches.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from oncekit.status.snapshot import Snapshot

METRICS: dict[str, str] = {
    "oncekit_last_planned_batch": "Newest batch id in Spark's offset log (planned)",
    "oncekit_last_completed_batch": "Newest batch id in Spark's commit log (checkpoint complete)",
    "oncekit_completed_batches": "Batches in Spark's commit log (Spark keeps the last 100 by default)",
    "oncekit_checkpoint_duration_seconds": "Last completed batch: from its offset log entry to its commit log entry",
    "oncekit_batch_records": "Source records in the last completed batch",
    "oncekit_commit_latency_seconds": "Last committed batch: from checkpoint complete to committed in every target",
    "oncekit_commit_lag_batches": "Batches whose checkpoint is complete but whose commit has not reached the target",
    "oncekit_uncommitted_batches": "Journaled batches not yet committed (running ones included)",
    "oncekit_oldest_uncommitted_batch_age_seconds": "Age of the oldest journaled batch not yet committed (0: none)",
    "oncekit_committed_batches": "Journaled batches marked committed that the journal still keeps",
    "oncekit_aborted_batches": "Journaled batches seen aborted or re-run by recovery since the status page started",
    "oncekit_source_end_offset": "End offset (high watermark) of a source partition",
    "oncekit_source_stable_offset": "Last stable offset of a source partition (held back by open transactions)",
    "oncekit_source_planned_offset": "End offset of the newest planned batch, per source partition",
    "oncekit_source_completed_offset": "End offset of the newest completed batch, per source partition",
    "oncekit_source_lag_records": "Records of a source partition not yet in a completed checkpoint",
    "oncekit_source_lag_growing": "1 when the query's total source lag grew in each of the last samples",
    "oncekit_prepared_transactions": "The kit's prepared transactions in PostgreSQL, per sink",
    "oncekit_prepared_transaction_oldest_age_seconds": "Age of the oldest of the kit's prepared transactions (0: none)",
    "oncekit_prepared_transaction_locks": "Locks held by the kit's prepared transactions",
    "oncekit_open_kafka_transactions": "Open Kafka transactions in the cluster (Ongoing, PrepareCommit, PrepareAbort)",
    "oncekit_open_kafka_transaction_oldest_age_seconds": "Age of the oldest open Kafka transaction (0: none)",
    "oncekit_restarts": "Query restarts by the restart strategy since the status page started (runner's page only)",
    "oncekit_stalled_batches": "Batches the batch watchdog found planned and not committed within the batch timeout "
                               "(it stopped the query for its restart strategy), ever, as recorded beside the checkpoint",
    "oncekit_exactly_once_at_risk": "1 while any red state holds (see oncekit_alerts)",
    "oncekit_alerts": "Red states now, per kind",
    "oncekit_status_source_up": "1 when the status page could read that source (checkpoint, kafka, postgres, ...) last time",
}


def _gauge(name: str, labels: list[str] | None = None) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, METRICS[name], labels=labels or [])


class SnapshotMetrics(Collector):
    """Called by prometheus_client at each scrape; ``latest`` gives the newest snapshot (None
    before the first, which yields no metrics)."""

    def __init__(self, latest: Callable[[], Snapshot | None]) -> None:
        self.latest = latest

    def collect(self) -> Iterator[Metric]:
        snapshot = self.latest()
        if snapshot is None:
            return
        yield from self._queries(snapshot)
        yield from self._services(snapshot)

    def _queries(self, snapshot: Snapshot) -> Iterator[Metric]:
        planned, completed = _gauge("oncekit_last_planned_batch", ["query"]), _gauge("oncekit_last_completed_batch", ["query"])
        count = _gauge("oncekit_completed_batches", ["query"])
        duration, records = _gauge("oncekit_checkpoint_duration_seconds", ["query"]), _gauge("oncekit_batch_records", ["query"])
        latency = _gauge("oncekit_commit_latency_seconds", ["query", "sink"])
        lag_batches = _gauge("oncekit_commit_lag_batches", ["query", "sink"])
        uncommitted = _gauge("oncekit_uncommitted_batches", ["query", "sink"])
        oldest = _gauge("oncekit_oldest_uncommitted_batch_age_seconds", ["query", "sink"])
        committed = _gauge("oncekit_committed_batches", ["query", "sink"])
        aborted = CounterMetricFamily("oncekit_aborted_batches", METRICS["oncekit_aborted_batches"], labels=["query", "sink"])
        offsets = {name: _gauge(name, ["query", "topic", "partition"]) for name in (
            "oncekit_source_end_offset", "oncekit_source_stable_offset", "oncekit_source_planned_offset",
            "oncekit_source_completed_offset", "oncekit_source_lag_records")}
        growing = _gauge("oncekit_source_lag_growing", ["query"])
        restarts = CounterMetricFamily("oncekit_restarts", METRICS["oncekit_restarts"], labels=["query"])
        stalled = CounterMetricFamily("oncekit_stalled_batches", METRICS["oncekit_stalled_batches"], labels=["query"])
        for query in snapshot.queries:
            if query.last_planned is not None:
                planned.add_metric([query.name], query.last_planned)
            if query.last_completed is not None:
                completed.add_metric([query.name], query.last_completed)
            count.add_metric([query.name], query.completed_batches)
            last = next((b for b in reversed(query.batches) if b.completed_at is not None), None)
            if last is not None and last.duration_s is not None:
                duration.add_metric([query.name], last.duration_s)
            if last is not None and last.records is not None:
                records.add_metric([query.name], last.records)
            for sink in query.sinks:
                labels = [query.name, sink.sink_id]
                if sink.commit_latency_s is not None:
                    latency.add_metric(labels, sink.commit_latency_s)
                lag_batches.add_metric(labels, sink.commit_lag_batches)
                uncommitted.add_metric(labels, len(sink.pending))
                oldest.add_metric(labels, max((p.age_s for p in sink.pending), default=0.0))
                committed.add_metric(labels, sink.committed)
                aborted.add_metric(labels, sink.aborted_total)
            for partition in query.partitions:
                labels = [query.name, partition.topic, str(partition.partition)]
                for name, value in (("oncekit_source_end_offset", partition.end_offset),
                                    ("oncekit_source_stable_offset", partition.stable_offset),
                                    ("oncekit_source_planned_offset", partition.planned_offset),
                                    ("oncekit_source_completed_offset", partition.completed_offset),
                                    ("oncekit_source_lag_records", partition.lag)):
                    if value is not None:
                        offsets[name].add_metric(labels, value)
            growing.add_metric([query.name], 1 if query.lag_growing else 0)
            restarts.add_metric([query.name], len(query.restarts))
            stalled.add_metric([query.name], query.stalls)
        yield from (planned, completed, count, duration, records, latency, lag_batches, uncommitted, oldest, committed,
                    aborted, *offsets.values(), growing, restarts, stalled)

    def _services(self, snapshot: Snapshot) -> Iterator[Metric]:
        up = _gauge("oncekit_status_source_up", ["source"])
        for query in snapshot.queries:
            up.add_metric([f"checkpoint:{query.name}"], 0 if query.error else 1)
        asked = {"kafka": any(p.end_offset is not None for q in snapshot.queries for p in q.partitions),
                 "postgres": snapshot.prepared is not None, "kafka_transactions": snapshot.kafka_transactions is not None}
        for source, answered in asked.items():
            if answered or source in snapshot.errors:
                up.add_metric([source], 0 if source in snapshot.errors else 1)
        yield up
        if snapshot.prepared is not None:
            prepared = _gauge("oncekit_prepared_transactions", ["sink"])
            per_sink: dict[str, int] = {}
            for transaction in snapshot.prepared:
                per_sink[transaction.sink_id or ""] = per_sink.get(transaction.sink_id or "", 0) + 1
            for sink_id, n in sorted(per_sink.items()):
                prepared.add_metric([sink_id], n)
            yield prepared
            oldest = _gauge("oncekit_prepared_transaction_oldest_age_seconds")
            oldest.add_metric([], max((t.age_s for t in snapshot.prepared), default=0.0))
            locks = _gauge("oncekit_prepared_transaction_locks")
            locks.add_metric([], sum(t.locks for t in snapshot.prepared))
            yield from (oldest, locks)
        if snapshot.kafka_transactions is not None:
            open_count = _gauge("oncekit_open_kafka_transactions")
            open_count.add_metric([], len(snapshot.kafka_transactions))
            oldest_open = _gauge("oncekit_open_kafka_transaction_oldest_age_seconds")
            oldest_open.add_metric([], max((t.age_s for t in snapshot.kafka_transactions), default=0.0))
            yield from (open_count, oldest_open)
        alerts = _gauge("oncekit_alerts", ["kind"])
        kinds: dict[str, int] = {kind: 0 for kind in ("prepared_transaction_too_old", "kafka_transaction_too_old",
                                                      "batch_not_committed", "lag_growing", "checkpoint_unreadable",
                                                      "batch_stalled")}
        for alert in snapshot.alerts:
            kinds[alert.kind] = kinds.get(alert.kind, 0) + 1
        for kind, n in kinds.items():
            alerts.add_metric([kind], n)
        risk = _gauge("oncekit_exactly_once_at_risk")
        risk.add_metric([], 1 if any(a.kind not in ("lag_growing", "batch_stalled") for a in snapshot.alerts) else 0)
        yield from (alerts, risk)


def registry(latest: Callable[[], Snapshot | None]) -> CollectorRegistry:
    """A registry of its own (not the process's global one) holding only the snapshot's metrics."""
    out = CollectorRegistry(auto_describe=False)
    out.register(SnapshotMetrics(latest))
    return out


def render(metrics: CollectorRegistry) -> bytes:
    """The text format, for ``/metrics``."""
    return generate_latest(metrics)

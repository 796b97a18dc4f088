"""What checkpoints, their journals and the services say right now, as one :class:`~oncekit.status.snapshot.Snapshot`.

:class:`StatusCollector` reads, for each watched checkpoint location, Spark's offset and commit
logs (:class:`~oncekit.core.spark_log.SparkLog`) and the kit's journal
(:class:`~oncekit.core.journal.Journal`) through the kit's storage layer, so it works for a
query on a cluster with HDFS or S3 checkpoints from any machine that reaches them; and it asks
the services through three callables (end offsets, prepared transactions, open Kafka
transactions; :mod:`oncekit.status.services` has the real ones, tests pass fakes). Each
:meth:`StatusCollector.collect` returns one immutable snapshot, which the status service of
:mod:`oncekit.status.app` keeps for the page and :mod:`oncekit.status.metrics`.

Times come from the files: a batch is planned when Spark writes ``offsets/<batch>``, its
checkpoint completes when Spark writes ``commits/<batch>``, and its output is committed in the
target when the journal's ``<batch>.done`` appears. Nothing here writes anywhere.

Red states (each an :class:`~oncekit.status.snapshot.Alert`): a prepared PostgreSQL or open
Kafka transaction older than the transaction timeout; a journaled batch still not committed
``uncommitted_triggers`` batches later; source lag that grew in each of the last
``lag_growth_samples`` samples.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pyarrow.fs import FileSelector, FileType

from oncekit.connectors.postgres import PreparedTransaction
from oncekit.core.errors import ConfigError
from oncekit.core.journal import Journal
from oncekit.core.names import TransactionId
from oncekit.core.spark_log import SparkLog, batch_ids
from oncekit.core.stalls import StallLog
from oncekit.core.storage import list_names
from oncekit.status.kafka_transactions import KafkaTransaction
from oncekit.status.snapshot import (
    AbortedBatch,
    Alert,
    BatchPoint,
    CommitMode,
    KafkaTransactionStatus,
    PartitionLag,
    PendingBatch,
    PreparedStatus,
    QueryStatus,
    Restart,
    SinkStatus,
    Snapshot,
    TargetStatus,
    Thresholds,
)

logger = logging.getLogger(__name__)

PartitionOffsets = Mapping[tuple[str, int], tuple[int | None, int | None]]
"""(topic, partition) -> (end offset, last stable offset), as the broker answers them."""

EndOffsets = Callable[[Mapping[str, Sequence[int]]], PartitionOffsets]
PreparedReader = Callable[[], Sequence[PreparedTransaction]]
KafkaTransactionReader = Callable[[], Sequence[KafkaTransaction]]


@dataclass(frozen=True)
class Watched:
    """One checkpoint location to show. ``protocols`` maps sink ids to their protocol when the
    caller knows the sinks (the pipeline runner does); otherwise the journal's committables say
    what they can (a transaction id: two-phase commit; a staged file: write-ahead log)."""

    name: str
    checkpoint: str
    protocols: Mapping[str, str] = field(default_factory=dict)


def _protocol_of(committables: Sequence[Any]) -> str | None:
    """What a sink's journaled committables, committed or not, say of its protocol; None when
    there are none (a protocol that commits in the task journals none)."""
    if any(c.transaction_id for c in committables):
        return "two-phase-commit"
    if any(c.staged_file for c in committables):
        return "write-ahead-log"
    return None


class _CheckpointCache:
    """What never changes once written, per checkpoint: each batch's end offsets and file times,
    and each committed journal entry's committables."""

    def __init__(self) -> None:
        self.offsets: dict[int, dict[tuple[str, int], int]] = {}
        self.planned_at: dict[int, float] = {}
        self.completed_at: dict[int, float] = {}
        self.done_entries: dict[tuple[str, int], list[Any]] = {}
        self.pending_seen: dict[str, dict[int, float]] = {}  # sink -> batch -> journal entry's time, last refresh
        self.aborted: dict[str, collections.deque[AbortedBatch]] = {}
        self.aborted_total: dict[str, int] = {}


def _mtimes(fs: Any, directory: str) -> dict[str, float]:
    """Base name -> modification time (seconds since the epoch) of the files in ``directory``."""
    infos = fs.get_file_info(FileSelector(directory, allow_not_found=True))
    return {info.base_name: info.mtime.timestamp() for info in infos
            if info.type == FileType.File and info.mtime is not None}


class StatusCollector:
    """Gathers :class:`Snapshot` s for the watched checkpoints. Called from the status service's
    refresh thread (one collect at a time); :meth:`record_restart` from any thread."""

    def __init__(self, watched: Sequence[Watched], thresholds: Thresholds | None = None, *,
                 end_offsets: EndOffsets | None = None, prepared: PreparedReader | None = None,
                 kafka_transactions: KafkaTransactionReader | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        names = [w.name for w in watched]
        if not watched or len(set(names)) != len(names):
            raise ConfigError(f"status: give at least one checkpoint, each under its own name; got {names}")
        self.watched = list(watched)
        self.thresholds = thresholds or Thresholds()
        self._end_offsets, self._prepared, self._kafka_transactions = end_offsets, prepared, kafka_transactions
        self._clock = clock
        self._caches = {w.name: _CheckpointCache() for w in watched}
        self._lag_samples: dict[str, collections.deque[tuple[float, int]]] = {
            w.name: collections.deque(maxlen=self.thresholds.lag_growth_samples) for w in watched}
        self._restarts: list[Restart] = []
        self._lock = threading.Lock()
        self._kafka_last: tuple[float, tuple[KafkaTransaction, ...] | None, str | None] | None = None

    def record_restart(self, query: str, cause: BaseException | str) -> None:
        """The pipeline runner's restart strategy restarted ``query`` (all queries: ``*``)."""
        text = str(cause).strip().splitlines()[0][:300] if str(cause).strip() else type(cause).__name__
        with self._lock:
            self._restarts.append(Restart(self._clock(), query, text))

    # -- one checkpoint --------------------------------------------------------------------------

    def _read_logs(self, watched: Watched) -> tuple[SparkLog, set[int], set[int], list[int]]:
        """Spark's logs of ``watched`` into its cache: (log, planned, completed, the batches shown)."""
        cache = self._caches[watched.name]
        log = SparkLog(watched.checkpoint)
        planned_times = _mtimes(log.fs, f"{log.root}/offsets")
        completed_times = _mtimes(log.fs, f"{log.root}/commits")
        planned = batch_ids(planned_times)
        completed = batch_ids(completed_times)
        for batch_id in planned:
            cache.planned_at.setdefault(batch_id, planned_times[str(batch_id)])
        for batch_id in completed:
            cache.completed_at.setdefault(batch_id, completed_times[str(batch_id)])
        shown = sorted(planned)[-self.thresholds.history_batches - 1:]
        if shown:  # a long-running query's cache keeps what the page shows, not every batch ever
            oldest = min(shown[0], min(completed, default=shown[0]))
            for stale in [b for b in cache.offsets if b < shown[0]]:
                del cache.offsets[stale]
            for times in (cache.planned_at, cache.completed_at):
                for stale in [b for b in times if b < oldest]:
                    del times[stale]
            for key in [k for k in cache.done_entries if k[1] < oldest]:
                del cache.done_entries[key]
        for batch_id in shown:
            if batch_id not in cache.offsets:
                cache.offsets[batch_id] = {
                    (topic, int(partition)): int(offset)
                    for source in log.source_offsets(batch_id) if isinstance(source, dict)
                    for topic, partitions in source.items() if isinstance(partitions, dict)
                    for partition, offset in partitions.items()}
        return log, planned, completed, shown

    def _query(self, watched: Watched, now: float, read: tuple[SparkLog, set[int], set[int], list[int]],
               offsets_by_partition: PartitionOffsets | None) -> QueryStatus:
        cache = self._caches[watched.name]
        log, planned, completed, shown = read
        last_planned = max(planned) if planned else None
        last_completed = max(completed) if completed else None
        sinks, committed_at = self._sinks(watched, log, cache, completed, last_planned, now)
        batches = []
        for batch_id in shown[-self.thresholds.history_batches:]:
            start, end = cache.planned_at.get(batch_id), cache.completed_at.get(batch_id)
            before = cache.offsets.get(batch_id - 1)
            records = (sum(cache.offsets[batch_id].values()) - sum(before.values())) if before is not None else None
            done = committed_at.get(batch_id)
            batches.append(BatchPoint(batch_id, start, end, end - start if start and end else None, records, done,
                                      max(0.0, done - end) if done and end else None))
        partitions = self._partitions(cache, last_planned, last_completed, offsets_by_partition)
        lags = [p.lag for p in partitions]
        lag = sum(x for x in lags if x is not None) if lags and all(x is not None for x in lags) else None
        growing = self._lag_growing(watched.name, now, lag)
        with self._lock:
            restarts = tuple(r for r in self._restarts if r.query in (watched.name, "*"))
        stalls, recent = StallLog(watched.checkpoint).read()
        return QueryStatus(watched.name, watched.checkpoint, last_planned, last_completed, len(completed),
                           tuple(batches), sinks, partitions, lag, growing, restarts, stalls=stalls,
                           stalls_recent=tuple(recent))

    def _sinks(self, watched: Watched, log: SparkLog, cache: _CheckpointCache, completed: set[int],
               last_planned: int | None, now: float) -> tuple[tuple[SinkStatus, ...], dict[int, float]]:
        """Each journal under ``<checkpoint>/oncekit/``, and per batch when its last journal
        marked it committed."""
        out = []
        committed_at: dict[int, float] = {}
        for sink_id in sorted(list_names(log.fs, f"{log.root}/oncekit", folders_only=True)):
            if "journal" not in list_names(log.fs, f"{log.root}/oncekit/{sink_id}"):
                continue
            journal = Journal(watched.checkpoint, sink_id)
            written, done_at = Journal.stamps(_mtimes(journal.fs, journal.directory))
            journaled, done = set(written), set(done_at)
            for batch_id, stamp in done_at.items():
                committed_at[batch_id] = max(committed_at.get(batch_id, 0.0), stamp)
            targets: dict[str, list[Any]] = {}
            for batch_id in sorted(journaled & done):
                key = (sink_id, batch_id)
                if key not in cache.done_entries:
                    try:
                        cache.done_entries[key] = journal.read(batch_id)
                    except FileNotFoundError:  # pruned between the listing and the read
                        continue
                for committable in cache.done_entries[key]:
                    targets.setdefault(committable.sink_id, []).append(committable)
            pending = []
            waiting: dict[str, list[Any]] = {}  # per target, the committables of batches not yet committed
            for batch_id in sorted(journaled - done):
                try:
                    committables = journal.read(batch_id)
                except FileNotFoundError:  # committed and pruned, or aborted, since the listing
                    continue
                for committable in committables:
                    targets.setdefault(committable.sink_id, [])
                    waiting.setdefault(committable.sink_id, []).append(committable)
                behind = (last_planned - batch_id) if last_planned is not None else 0
                pending.append(PendingBatch(batch_id, max(0.0, now - written[batch_id]), batch_id in completed,
                                            behind, len(committables), behind >= self.thresholds.uncommitted_triggers))
            self._observe_aborts(cache, sink_id, {b: written[b] for b in journaled - done}, done, now)
            if watched.protocols.get(sink_id) == "fan-out":
                for target in watched.protocols:
                    if target != sink_id:
                        targets.setdefault(target, [])
            target_status = tuple(
                self._target(target, watched.protocols.get(target), found, waiting.get(target, []))
                for target, found in sorted(targets.items()) if target != sink_id)
            protocol = watched.protocols.get(sink_id) or (
                "fan-out" if target_status
                else _protocol_of(targets.get(sink_id, []) + waiting.get(sink_id, [])) or "commits in the task")
            latencies = [done_at[b] - cache.completed_at[b] for b in sorted(done)[-1:] if b in cache.completed_at]
            out.append(SinkStatus(
                sink_id, protocol, target_status, len(journaled), len(journaled & done),
                max(journaled & done) if journaled & done else None,
                sum(1 for p in pending if p.completed), max(0.0, latencies[-1]) if latencies else None, tuple(pending),
                tuple(cache.aborted.get(sink_id, ())), cache.aborted_total.get(sink_id, 0)))
        return tuple(out), committed_at

    @staticmethod
    def _target(sink_id: str, known: str | None, committed: Sequence[Any], waiting: Sequence[Any]) -> TargetStatus:
        """A fan-out target: its protocol as the caller knows it, else as its committables say;
        its commit mode from that protocol, never from whether it has committed anything yet."""
        protocol = known or _protocol_of([*committed, *waiting]) or CommitMode.UNKNOWN.value
        return TargetStatus(sink_id, protocol, CommitMode.of(protocol), len(committed), sum(c.rows for c in committed))

    @staticmethod
    def _observe_aborts(cache: _CheckpointCache, sink_id: str, pending: dict[int, float], done: set[int],
                        now: float) -> None:
        """Compare with the last refresh: a pending batch gone without being marked done was
        aborted by recovery (the engine aborts and forgets a journaled batch whose checkpoint
        never completed); one journaled anew was re-run after its first attempt was aborted."""
        before = cache.pending_seen.get(sink_id)
        cache.pending_seen[sink_id] = dict(pending)
        if before is None:
            return
        seen = cache.aborted.setdefault(sink_id, collections.deque(maxlen=50))
        for batch_id, stamp in sorted(before.items()):
            if batch_id in done:
                continue
            how = ("journal entry removed: checkpoint never completed" if batch_id not in pending
                   else "journaled again: re-run after an abort" if pending[batch_id] > stamp else None)
            if how is not None:
                seen.append(AbortedBatch(batch_id, now, how))
                cache.aborted_total[sink_id] = cache.aborted_total.get(sink_id, 0) + 1

    def _partitions(self, cache: _CheckpointCache, last_planned: int | None, last_completed: int | None,
                    end: PartitionOffsets | None) -> tuple[PartitionLag, ...]:
        if last_planned is None:
            return ()
        planned = cache.offsets.get(last_planned, {})
        done = cache.offsets.get(last_completed, {}) if last_completed is not None else {}
        out = []
        for (topic, partition), offset in sorted(planned.items()):
            end_offset, stable = (end or {}).get((topic, partition), (None, None))
            completed_offset = done.get((topic, partition)) if last_completed is not None else None
            lag = None if end_offset is None else max(0, end_offset - (completed_offset or 0))
            out.append(PartitionLag(topic, partition, end_offset, stable, offset, completed_offset, lag))
        return tuple(out)

    def _lag_growing(self, name: str, now: float, lag: int | None) -> bool:
        samples = self._lag_samples[name]
        if lag is not None and (not samples or now - samples[-1][0] >= self.thresholds.lag_sample_interval_s):
            samples.append((now, lag))
        values = [v for _, v in samples]
        return lag is not None and len(values) == samples.maxlen and all(b > a for a, b in zip(values, values[1:]))

    def source_partitions(self) -> dict[str, list[int]]:
        """Topic -> partitions the watched queries planned last (what to ask the broker about)."""
        out: dict[str, set[int]] = {}
        for cache in self._caches.values():
            if cache.offsets:
                for topic, partition in cache.offsets[max(cache.offsets)]:
                    out.setdefault(topic, set()).add(partition)
        return {topic: sorted(partitions) for topic, partitions in out.items()}

    # -- everything ------------------------------------------------------------------------------

    def collect(self, ask_kafka_transactions: bool = True) -> Snapshot:
        """One snapshot. With ``ask_kafka_transactions`` it first asks the broker for open
        transactions (:meth:`ask_kafka_transactions`, which starts JVMs); without, it uses the last
        answer, which the caller refreshes on a thread of its own. A failing service or
        checkpoint never raises: it shows in ``errors`` (no secrets)."""
        if ask_kafka_transactions:
            self.ask_kafka_transactions()
        from oncekit.connectors.redact import redact_dsn

        now = self._clock()
        errors: dict[str, str] = {}
        offsets: PartitionOffsets | None = None
        reads: list[tuple[SparkLog, set[int], set[int], list[int]] | Exception] = []
        for watched in self.watched:
            try:
                reads.append(self._read_logs(watched))
            except Exception as exc:
                reads.append(exc)
        wanted = self.source_partitions()
        if self._end_offsets is not None and wanted:
            try:
                offsets = self._end_offsets(wanted)
            except Exception as exc:  # shown on the page; the next refresh asks again
                errors["kafka"] = redact_dsn(str(exc) or type(exc).__name__)[:300]
        queries = []
        for watched, read in zip(self.watched, reads):
            try:
                if isinstance(read, Exception):
                    raise read
                queries.append(self._query(watched, now, read, offsets))
            except Exception as exc:
                logger.warning("status: checkpoint %s unreadable: %s", watched.checkpoint, exc)
                queries.append(QueryStatus(watched.name, watched.checkpoint, None, None, 0, (), (), (), None, False, (),
                                           error=redact_dsn(str(exc))[:300]))
        prepared = None
        if self._prepared is not None:
            try:
                prepared = tuple(self._prepared_status(t, queries) for t in self._prepared())
            except Exception as exc:
                errors["postgres"] = redact_dsn(str(exc) or type(exc).__name__)[:300]
        kafka_transactions, kafka_at = self._kafka(now, errors)
        alerts = self._alerts(queries, prepared, kafka_transactions)
        return Snapshot(now, self.thresholds, tuple(queries), prepared, kafka_transactions, kafka_at,
                        alerts, errors)

    def ask_kafka_transactions(self) -> None:
        """Ask the broker for its open transactions now and keep the answer (or the error) for
        the next snapshots. Safe to call from a thread of its own."""
        if self._kafka_transactions is None:
            return
        asked_at = self._clock()
        try:
            answer: tuple[float, tuple[KafkaTransaction, ...] | None, str | None] = (
                asked_at, tuple(self._kafka_transactions()), None)
        except Exception as exc:
            answer = (asked_at, None, (str(exc) or type(exc).__name__)[:300])
        with self._lock:
            self._kafka_last = answer

    def _kafka(self, now: float,
               errors: dict[str, str]) -> tuple[tuple[KafkaTransactionStatus, ...] | None, float | None]:
        with self._lock:
            last = self._kafka_last
        if self._kafka_transactions is None or last is None:
            return None, None
        asked_at, found, error = last
        if error is not None:
            errors["kafka_transactions"] = error
        if found is None:
            return None, asked_at
        timeout = self.thresholds.transaction_timeout_s
        return tuple(KafkaTransactionStatus(t.transactional_id, t.state, t.age_s + (now - asked_at), t.timeout_ms / 1000,
                                            t.partitions, t.age_s + (now - asked_at) > timeout)
                     for t in found), asked_at

    def _prepared_status(self, transaction: PreparedTransaction, queries: Sequence[QueryStatus]) -> PreparedStatus:
        parsed = TransactionId.parse(transaction.gid)
        red = transaction.age_s > self.thresholds.transaction_timeout_s
        if parsed is None:
            return PreparedStatus(transaction.gid, None, None, None, None, "not a name oncekit makes",
                                  transaction.age_s, transaction.locks, transaction.relations, red)
        owner, state = None, "no watched query writes this sink"
        for query in queries:
            for sink in query.sinks:
                if parsed.sink_id != sink.sink_id and parsed.sink_id not in {t.sink_id for t in sink.targets}:
                    continue
                owner = query.name
                waiting = {p.batch_id: p for p in sink.pending}
                if parsed.batch_id in waiting:
                    state = ("checkpoint complete, commit pending" if waiting[parsed.batch_id].completed
                             else "journaled, checkpoint not complete")
                elif query.last_planned == parsed.batch_id and parsed.batch_id != query.last_completed:
                    state = "batch running"
                else:
                    state = "not journaled: recovery aborts it at the next batch"
        return PreparedStatus(transaction.gid, parsed.sink_id, parsed.batch_id, parsed.partition_id, owner, state,
                              transaction.age_s, transaction.locks, transaction.relations, red)

    def _alerts(self, queries: Sequence[QueryStatus], prepared: Sequence[PreparedStatus] | None,
                kafka: Sequence[KafkaTransactionStatus] | None) -> tuple[Alert, ...]:
        timeout = self.thresholds.transaction_timeout_s
        alerts = []
        for query in queries:
            if query.error:
                alerts.append(Alert("checkpoint_unreadable", f"{query.name}: {query.error}"))
            for sink in query.sinks:
                for batch in sink.pending:
                    if batch.red:
                        alerts.append(Alert("batch_not_committed",
                                            f"{query.name} sink {sink.sink_id} batch {batch.batch_id}: journaled "
                                            f"{batch.age_s:.0f} s ago, not committed {batch.behind} batches later"))
            stall = query.stalls_recent[0] if query.stalls_recent else None
            if stall is not None and self._clock() - stall.at < self.thresholds.stall_alert_s:
                alerts.append(Alert("batch_stalled", f"{query.name}: {stall.message} at "
                                                     f"{time.strftime('%H:%M:%S', time.localtime(stall.at))}"))
            if query.lag_growing:
                alerts.append(Alert("lag_growing", f"{query.name}: source lag {query.lag_records} records, grew in each "
                                                   f"of the last {self.thresholds.lag_growth_samples} samples"))
        for transaction in prepared or ():
            if transaction.red:
                alerts.append(Alert("prepared_transaction_too_old",
                                    f"prepared transaction {transaction.gid}: {transaction.age_s:.0f} s old (timeout "
                                    f"{timeout:.0f} s), {transaction.locks} locks on "
                                    f"{', '.join(transaction.relations) or 'no relation'}; {transaction.state}"))
        for open_transaction in kafka or ():
            if open_transaction.red:
                alerts.append(Alert("kafka_transaction_too_old",
                                    f"Kafka transaction {open_transaction.transactional_id} open "
                                    f"{open_transaction.age_s:.0f} s on {', '.join(open_transaction.partitions)}: "
                                    "read_committed consumers of those partitions are blocked"))
        return tuple(alerts)

"""The status page's snapshot: frozen, plain data about the watched checkpoints and services at
one moment.

:class:`~oncekit.status.collector.StatusCollector` fills a :class:`Snapshot` at each refresh;
:mod:`oncekit.status.app` serves it as JSON to the page (``/api/status``) and
:mod:`oncekit.status.metrics` turns it into Prometheus metrics. Nothing here reads or writes
anything.

How a target's output becomes visible follows from its protocol (:class:`CommitMode`, after the
protocol bases of :mod:`oncekit.core.protocol`), inside a fan-out as well as alone: the page
shows per target who commits it.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from oncekit.core.errors import ConfigError
from oncekit.core.bases import AtLeastOnceSink, IdempotentSink, TaskCommitSink, TwoPhaseCommitSink, WriteAheadSink
from oncekit.core.stalls import Stall


class CommitMode(str, enum.Enum):
    """Who makes a sink's or fan-out target's writes visible. A string, so the page's JSON holds
    its value."""

    TASK = "task"
    """Each task commits its own writes (transactional, idempotent, at-least-once); the journal
    holds nothing for them."""
    CHECKPOINT = "checkpoint-complete"
    """The driver commits the journaled committables once the checkpoint completes (two-phase
    commit, write-ahead log); recovery commits or aborts them."""
    UNKNOWN = "unknown"
    """The protocol is not known and nothing journaled says it."""

    @classmethod
    def of(cls, protocol: str) -> CommitMode:
        """The commit mode of a protocol name (a sink configuration's ``protocol``)."""
        return _COMMIT_MODES.get(protocol, cls.UNKNOWN)


_COMMIT_MODES: dict[str, CommitMode] = {
    TwoPhaseCommitSink.protocol: CommitMode.CHECKPOINT,
    WriteAheadSink.protocol: CommitMode.CHECKPOINT,
    TaskCommitSink.protocol: CommitMode.TASK,
    IdempotentSink.protocol: CommitMode.TASK,
    AtLeastOnceSink.protocol: CommitMode.TASK,
}


@dataclass(frozen=True)
class Thresholds:
    """When the page turns red. ``transaction_timeout_s`` should be the sinks' transaction
    timeout (the Kafka sinks' default is 60 s): a transaction open longer has outlived every
    commit the kit would make for it, and blocks readers or holds locks."""

    transaction_timeout_s: float = 60.0
    uncommitted_triggers: int = 3
    lag_growth_samples: int = 6
    lag_sample_interval_s: float = 10.0
    history_batches: int = 200
    stall_alert_s: float = 900.0  # how long a stall the batch watchdog recorded stays red

    def __post_init__(self) -> None:
        if self.transaction_timeout_s <= 0 or self.lag_sample_interval_s < 0:
            raise ConfigError("status: transaction_timeout_s must be above 0 and lag_sample_interval_s not below 0")
        if self.uncommitted_triggers < 1 or self.lag_growth_samples < 2 or self.history_batches < 1:
            raise ConfigError("status: uncommitted_triggers and history_batches must be at least 1, "
                              "lag_growth_samples at least 2")


@dataclass(frozen=True)
class BatchPoint:
    batch_id: int
    planned_at: float | None
    completed_at: float | None
    duration_s: float | None
    records: int | None
    committed_at: float | None
    commit_latency_s: float | None  # checkpoint complete -> committed in every target


@dataclass(frozen=True)
class PendingBatch:
    """A journaled batch whose commit has not reached the target yet."""

    batch_id: int
    age_s: float
    completed: bool  # Spark logged it: only the commit is missing
    behind: int  # batches planned since
    committables: int
    red: bool


@dataclass(frozen=True)
class TargetStatus:
    """One target of a fan-out. ``commit_mode`` follows ``protocol``: a two-phase-commit or
    write-ahead-log target is committed by the driver on checkpoint-complete, as it would be
    alone; the committed counts are of its committables in the journal entries marked done."""

    sink_id: str
    protocol: str
    commit_mode: CommitMode
    committed_committables: int
    committed_rows: int


@dataclass(frozen=True)
class AbortedBatch:
    """A journaled batch seen to leave the journal uncommitted (recovery aborted it: its
    checkpoint never completed), or journaled anew (a re-run replaced the first attempt)."""

    batch_id: int
    seen_at: float
    how: str


@dataclass(frozen=True)
class SinkStatus:
    """One journal (a sink, or a fan-out with its targets). ``aborted`` holds what this page saw
    since it started (the journal keeps no record of aborts), newest last."""

    sink_id: str
    protocol: str
    targets: tuple[TargetStatus, ...]
    journaled: int
    committed: int
    last_committed: int | None
    commit_lag_batches: int
    commit_latency_s: float | None
    pending: tuple[PendingBatch, ...]
    aborted: tuple[AbortedBatch, ...] = ()
    aborted_total: int = 0


@dataclass(frozen=True)
class PartitionLag:
    topic: str
    partition: int
    end_offset: int | None
    stable_offset: int | None
    planned_offset: int
    completed_offset: int | None
    lag: int | None


@dataclass(frozen=True)
class Restart:
    at: float
    query: str
    cause: str


@dataclass(frozen=True)
class QueryStatus:
    name: str
    checkpoint: str
    last_planned: int | None
    last_completed: int | None
    completed_batches: int
    batches: tuple[BatchPoint, ...]
    sinks: tuple[SinkStatus, ...]
    partitions: tuple[PartitionLag, ...]
    lag_records: int | None
    lag_growing: bool
    restarts: tuple[Restart, ...]
    error: str | None = None
    stalls: int = 0  # batch watchdog stalls ever recorded beside the checkpoint
    stalls_recent: tuple[Stall, ...] = ()  # the newest first


@dataclass(frozen=True)
class PreparedStatus:
    gid: str
    sink_id: str | None
    batch_id: int | None
    partition_id: int | None
    query: str | None
    state: str
    age_s: float
    locks: int
    relations: tuple[str, ...]
    red: bool


@dataclass(frozen=True)
class KafkaTransactionStatus:
    transactional_id: str
    state: str
    age_s: float
    timeout_s: float
    partitions: tuple[str, ...]
    red: bool


@dataclass(frozen=True)
class Alert:
    kind: str
    message: str


@dataclass(frozen=True)
class Snapshot:
    """Everything the page and /metrics show, at ``taken_at`` (seconds since the epoch). A
    service that could not be asked leaves its list None and says why in ``errors``."""

    taken_at: float
    thresholds: Thresholds
    queries: tuple[QueryStatus, ...]
    prepared: tuple[PreparedStatus, ...] | None
    kafka_transactions: tuple[KafkaTransactionStatus, ...] | None
    kafka_transactions_at: float | None
    alerts: tuple[Alert, ...]
    errors: Mapping[str, str]

    def to_json(self) -> dict[str, Any]:
        """Plain JSON types (enums as their values), for ``/api/status``."""
        return asdict(self, dict_factory=_plain)


def _plain(items: list[tuple[str, Any]]) -> dict[str, Any]:
    return {key: value.value if isinstance(value, enum.Enum) else value for key, value in items}

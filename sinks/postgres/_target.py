"""What the PostgreSQL sinks' protocols ask of the server, as operations (no SQL): the one seam
between their decisions (:mod:`oncekit.sinks.postgres.two_phase_commit`, ...) and PostgreSQL.

:class:`PostgresTarget` is implemented once with psycopg (:mod:`oncekit.sinks.postgres._psycopg`)
and once as an in-memory model for the deterministic simulation of overlapping drivers (tests/sim),
whose contract test runs the same operations against both and checks they answer alike. Which
implementation a sink gets is :func:`target_for`'s to say, from its connection string.

Every operation that decides what a batch is carries the acting run's epoch and is refused with
FencedError, in the same transaction, when the sink's row in ``oncekit_sinks`` holds a newer one;
an epoch of 0 (no run) is refused too. What a session holds while its client is paused is bounded
by the server (``idle_in_transaction_session_timeout``): :data:`DRIVER_IDLE_S` for the driver's
sessions, the task bound (:func:`task_idle_s`) for the tasks'.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from oncekit.core.errors import CommitError, ConfigError
from oncekit.core.protocol import Committable, SinkOwner, TaskInfo

if TYPE_CHECKING:
    import pyarrow as pa

    from oncekit.sinks.postgres.config import PostgresSinkConfig

DRIVER_IDLE_S = 20
"""How long a driver's session may sit inside a transaction without a statement before the server
ends it (its locks with it): a driver frozen mid-publish holds the sink's row and keys no longer."""
TASK_IDLE_ENV = "ONCEKIT_TASK_SESSION_IDLE_S"
DEFAULT_TASK_IDLE_S = 300
"""The same bound for a task's session (its input may pause while Spark computes it upstream):
the default batch timeout, past which the batch watchdog gives the batch up anyway."""


def task_idle_s() -> int:
    """A task session's bound (``ONCEKIT_TASK_SESSION_IDLE_S``, default :data:`DEFAULT_TASK_IDLE_S`)."""
    setting = os.environ.get(TASK_IDLE_ENV, str(DEFAULT_TASK_IDLE_S))
    if not setting.isdigit() or int(setting) < 1:
        raise ConfigError(f"{TASK_IDLE_ENV}={setting!r}: give whole seconds, at least 1")
    return int(setting)


class PreparingTransaction(ABC):
    """A task's open transaction of the two-phase-commit protocol (:meth:`PostgresTarget.begin`),
    named ``task.transaction_id``."""

    def __init__(self, task: TaskInfo) -> None:
        self.task = task

    @abstractmethod
    def write(self, batch: pa.RecordBatch) -> None:
        """Write one Arrow batch of the partition."""

    @abstractmethod
    def prepare(self) -> int:
        """Refuse a superseded run (of ``task.epoch``) (read, not locked: a prepared transaction cannot keep a lock
        the newer run's start needs), insert the partition's marker (whose unique key lets one
        transaction per batch partition commit), PREPARE TRANSACTION under the task's id; the
        rows written. The session goes back to its pool."""

    @abstractmethod
    def abort(self) -> None:
        """Roll the transaction back (close the session)."""


class PostgresTarget(ABC):
    """One sink's table and the kit's tables beside it, as the protocols use them."""

    def __init__(self, config: PostgresSinkConfig) -> None:
        self.config = config

    # -- driver: checks, epoch, owner --------------------------------------------------------

    @abstractmethod
    def preflight(self) -> None:
        """The server and table are usable by the config's protocol (its kit tables made)."""

    @abstractmethod
    def take_epoch(self, checkpoint: str, floor: int) -> int:
        """Raise the sink's epoch above its own and ``floor``, atomically; the new epoch."""

    @abstractmethod
    def hold_epoch(self, checkpoint: str, epoch: int) -> None:
        """Raise the sink's epoch to ``epoch``; FencedError if it holds a newer one."""

    @abstractmethod
    def owner(self) -> SinkOwner | None:
        """The query recorded as writing through the sink."""

    @abstractmethod
    def record_owner(self, owner: SinkOwner, epoch: int) -> None:
        """Record ``owner``, fenced by ``epoch``."""

    @abstractmethod
    def delete_batch_records(self, table: str, before: int | None, epoch: int) -> int:
        """Delete this sink's rows of ``table`` (a kit table: markers, recorded checkpoints,
        decisions) of batches before ``before`` (all for None), fenced by ``epoch``."""

    # -- two-phase commit --------------------------------------------------------------------

    @abstractmethod
    def prepared(self, batch_ids: Iterable[int] | None) -> list[Committable]:
        """The sink's prepared transactions, of ``batch_ids`` or all."""

    @abstractmethod
    def finish_prepared(self, transaction_id: str, commit: bool) -> bool:
        """COMMIT or ROLLBACK PREPARED; False when the id is gone."""

    @abstractmethod
    def marker_visible(self, transaction_id: str) -> bool:
        """Whether the committed marker of ``transaction_id`` is there."""

    @abstractmethod
    def begin(self, task: TaskInfo) -> PreparingTransaction:
        """A task's transaction, open, on a session of its own."""

    @abstractmethod
    def decide(self, batch_id: int, epoch: int, verdict: str) -> str:
        """Record (sink, batch, epoch) as ``"decided"`` (fenced by ``epoch``) or ``"vetoed"``,
        unless recorded already; the verdict that stands."""

    @abstractmethod
    def decisions(self, batch_ids: Iterable[int]) -> dict[int, set[int]]:
        """For each of ``batch_ids``, the epochs whose decision of it is recorded."""

    # -- write-ahead log, idempotent, at-least-once ------------------------------------------

    @abstractmethod
    def publish(self, batch_id: int, epoch: int, rows: int,
                parts: Iterator[tuple[TaskInfo, Iterator[pa.RecordBatch]]]) -> bool:
        """In one transaction: write ``parts``, then refuse a superseded run (the sink's row share-
        locked from here to the commit, so a newer run's epoch waits for the commit, never for
        the writing) and record (sink, batch) with ``rows``; commit. False (and nothing written)
        when (sink, batch) was recorded before."""

    @abstractmethod
    def published(self, batch_id: int) -> bool:
        """Whether (sink, batch) is recorded as published."""

    @abstractmethod
    def write_and_commit(self, task: TaskInfo, batches: Iterator[pa.RecordBatch], epoch: int | None) -> int:
        """A task's partition in one transaction of its own, committed; fenced by ``epoch`` and
        by the sink's newest batch in ``oncekit_partitions``, over every partition (CommitError
        when it is newer than the task's: a newer run may have planned fewer tasks), or, for None, unfenced (the at-least-once protocol). The rows written."""


def older_batch(sink_id: str, where: str) -> CommitError:
    """The refusal of a task's rows of an older batch than the target holds already."""
    return CommitError(f"sink {sink_id} {where}: the target holds rows of a later batch already: this "
                       "driver's Spark runs a batch that another driver completed (it read the checkpoint before that "
                       "driver's batches); nothing of it is written, and its restart reads the checkpoint again")


_TARGETS: dict[str, Callable[[PostgresSinkConfig], PostgresTarget]] = {}


def register_target(prefix: str, make: Callable[[PostgresSinkConfig], PostgresTarget]) -> None:
    """Connection strings that start with ``prefix`` reach their server through ``make``'s target
    (the simulation's model of PostgreSQL); any other through psycopg."""
    _TARGETS[prefix] = make


def target_for(config: PostgresSinkConfig) -> PostgresTarget:
    """The target of ``config``'s sink: psycopg's, unless a registered prefix names another."""
    for prefix, make in _TARGETS.items():
        if config.dsn.startswith(prefix):
            return make(config)
    from oncekit.sinks.postgres._psycopg import PsycopgTarget

    return PsycopgTarget(config)

"""The contract between the checkpoint engine and every sink: what a sink implements so that
the engine can make it exactly-once, and what a sink's configuration provides.

A sink subclasses one of the protocol bases of :mod:`oncekit.core.bases` (two-phase commit,
write-ahead log, idempotent, task commit, at-least-once) and nothing else; it never sees Spark.

Fencing, the part every sink shares (``docs/concepts.md``, "Fencing"): each run of a query acts
for an epoch that no other run holds. The epoch comes from one linearizable step at the sink's
target (:meth:`Sink.take_epoch`: an ``UPDATE ... RETURNING`` on a PostgreSQL row, a transaction
on a Kafka partition that only one producer can commit), and every act that decides what a
batch is (a decision, a commit of a batch's rows, a marker, a reset) is checked against the
target's epoch in the same atomic step, so a run that a newer one superseded changes nothing,
however long it slept.
"""

from __future__ import annotations

import enum
import logging
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from oncekit.core.errors import ConfigError
from oncekit.core.names import StagedFile, TransactionId

if TYPE_CHECKING:
    import pyarrow as pa

logger = logging.getLogger(__name__)

_SINK_ID = re.compile(r"^[A-Za-z0-9_.-]{1,100}$")


class DeliveryGuarantee(enum.Enum):
    """What a sink promises about each input record's effect on the target after failures."""

    AT_MOST_ONCE = "at-most-once"
    AT_LEAST_ONCE = "at-least-once"
    EXACTLY_ONCE = "exactly-once"


class CommitOutcome(enum.Enum):
    """How a commit or abort request ended. Anything else raises a named error."""

    COMMITTED = "committed"
    ALREADY_COMMITTED = "already committed"
    ABORTED = "aborted"
    ALREADY_ABORTED = "already aborted"


@dataclass(frozen=True)
class TaskInfo:
    """Where a task writes: the sink, the checkpoint (= Spark batch id), the partition, the
    attempt (Spark's task attempt id: unique among all task attempts of the application), and
    the epoch of the query run the task belongs to (its fencing token; 0: a run that takes none)."""

    sink_id: str
    batch_id: int
    partition_id: int
    attempt: int
    epoch: int = 0

    @property
    def transaction_id(self) -> str:
        """Deterministic per (sink, batch, partition, attempt, epoch): a retried task gets a new
        id, and so does a replayed batch in a later run."""
        return str(TransactionId(self.sink_id, self.batch_id, self.partition_id, self.attempt, self.epoch))

    @property
    def staged_file(self) -> str:
        """The task's write-ahead-log file, relative to the sink's staging folder."""
        return str(StagedFile(self.batch_id, self.partition_id, self.attempt, self.epoch))


@dataclass(frozen=True)
class Committable:
    """What a task pre-committed, journaled by the driver, committed once the checkpoint completes.

    Exactly one of ``transaction_id`` (an open transaction: two-phase commit) and ``staged_file``
    (rows staged under the checkpoint, relative to the sink's staging folder: write-ahead log) is
    set; ``epoch`` is the query run's that made it. Frozen and JSON-serializable: the journal
    stores it as a dict.
    """

    sink_id: str
    batch_id: int
    partition_id: int
    attempt: int
    rows: int
    transaction_id: str | None = None
    staged_file: str | None = None
    epoch: int = 0

    @property
    def name(self) -> str:
        """What the committable holds open in the target or the checkpoint."""
        return self.transaction_id or self.staged_file or ""

    @property
    def key(self) -> tuple[str, str]:
        """Its identity among the committables of every sink of a query: (sink, name)."""
        return self.sink_id, self.name

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))  # flat fields: a copy of the instance's (asdict deep-copies each, for nothing)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Committable:
        return cls(**data)


@dataclass(frozen=True)
class SinkOwner:
    """The query that writes through a sink id: its Spark query id (kept in its checkpoint) and
    its checkpoint location. Recorded in the target, so that a second checkpoint is refused."""

    query_id: str
    checkpoint: str


class Sink(ABC):
    """The engine's view of every sink. Subclass one of the protocol bases
    (:mod:`oncekit.core.bases`), not this."""

    protocol: ClassVar[str]
    guarantee: ClassVar[DeliveryGuarantee] = DeliveryGuarantee.EXACTLY_ONCE
    blocking_pre_commits: ClassVar[bool] = False
    """Whether what a task pre-commits holds something a replay of its batch needs (a prepared
    transaction holds its marker's key and its rows' locks). Then recovery commits every decided
    batch at once, complete or not, and aborts what no decision names, and a run's own aborts are
    vetoed decisions (:meth:`veto`). Otherwise (staged files) a pre-commit is kept until its batch
    is done, whoever's it is."""
    sink_id: str
    epoch: int = 0
    """The epoch of the query run this sink object acts for (:meth:`act_for`); 0 for none: a sink
    whose acts are fenced refuses to act for no run."""

    def act_for(self, epoch: int) -> None:
        """Engine: this object acts for the query run of ``epoch`` from now on."""
        self.epoch = epoch

    def targets(self) -> list[Sink]:
        """The sinks whose protocols the engine drives: this one; each target of a fan-out."""
        return [self]

    def take_epoch(self, floor: int) -> int:
        """Driver, at a query run's start, before its recovery: a new epoch, above ``floor`` (the
        newest the journal knows) and above every epoch the target gave before, taken and
        recorded in one linearizable step at the target, so that no two runs ever hold the same
        one and the target refuses every older run's acts from then on. An exactly-once sink must
        have such a register; an at-least-once sink, which fences nothing, takes ``floor + 1``."""
        if self.guarantee is DeliveryGuarantee.AT_LEAST_ONCE:
            return floor + 1
        raise ConfigError(f"sink {self.sink_id}: {type(self).__name__} has no epoch register at its target")

    def hold_epoch(self, epoch: int) -> None:
        """Driver, at the start of a run whose epoch another target gave (a fan-out's): raise the
        target's register to ``epoch``, so that it refuses older runs from now on; FencedError if
        it holds a newer one already. The default (no register) does nothing."""

    def decide(self, batch_id: int, committables: Sequence[Committable]) -> None:
        """Driver, in the stream writer's commit of ``batch_id``, right after the journal entry:
        make this run's decision of the batch final at the target, fenced (FencedError when a newer
        run holds the target: the entry then counts for nothing). Only a sink with
        :attr:`blocking_pre_commits` needs it; the default records nothing, and every journal
        entry counts."""

    def decided(self, batch_ids: Iterable[int]) -> dict[int, set[int]] | None:
        """Driver: for each of ``batch_ids``, the epochs whose decision of it the target holds
        (:meth:`decide`); None (the default) when every journal entry counts."""
        return None

    def veto(self, batch_id: int) -> bool:
        """Driver, before this run aborts what it pre-committed for ``batch_id`` (Spark gave the
        batch up, the query stopped): close the batch to decisions of this run's epoch, at the
        target. True when it is closed (nothing of this run's is ever decided for it); False when
        this run decided it already. The default, without decisions: True."""
        return True

    @property
    def commits_in_task(self) -> bool:
        """Whether a task makes its writes final itself (a task-commit sink, or a fan-out with
        one): then a task whose input Spark cut short must commit nothing."""
        return False

    def preflight(self, resumed: bool = False) -> None:
        """Driver, once per query start: check the target (tables, server settings) and raise a
        ConfigError that says what to fix. ``resumed``: this checkpoint has run the sink before,
        so what the sink keeps beside the target (markers) must be there. The default checks
        nothing."""

    @abstractmethod
    def write_partition(self, task: TaskInfo, batches: Iterator[pa.RecordBatch]) -> list[Committable]:
        """Task: write one partition of one batch; return what the driver must journal (nothing
        for protocols that commit in the task; several for a sink that fans out)."""

    def commit_batch(self, batch_id: int, committables: Sequence[Committable]) -> None:
        """Driver (or listener): make a completed checkpoint's output visible. Idempotent."""

    def abort_batch(self, batch_id: int, committables: Sequence[Committable]) -> None:
        """Driver: discard what an incomplete checkpoint pre-committed. Idempotent."""

    def leftovers(self, batch_ids: Iterable[int] | None = None) -> list[Committable]:
        """Driver: what the target still holds open for this sink (prepared transactions,
        staged files), for batches in ``batch_ids`` or all. Recovery aborts older runs' that no
        decision names (where pre-commits block a replay), or those of batches already done
        (staged files). The default holds nothing open."""
        return []

    def refuse_claimed(self, owner: SinkOwner, in_use: Callable[[SinkOwner, SinkOwner], str | None]) -> None:
        """Driver, at query start after ``preflight``: refuse (ConfigError) a sink id whose
        recorded owner still holds it against ``owner`` (``in_use`` says why, or None when it
        does not: see :func:`oncekit.core.engine.owner_in_use`). Two checkpoints on one sink id
        share transaction ids, markers and marker rows: each would take the other's batches for
        its own and skip them, or abort the other's transactions. A checkpoint deleted to start
        over, or a savepoint restored (same query id) while its original is stopped, may take the
        id over (:meth:`claim`). Not atomic: two first starts at the same moment both pass."""
        current = self.recorded_owner()
        if current is not None and current != owner:
            reason = in_use(current, owner)
            if reason is not None:
                raise ConfigError(f"sink {self.sink_id}: {reason}; this query's checkpoint is {owner.checkpoint}")

    def claim(self, owner: SinkOwner) -> None:
        """Driver, at a query run's start after its epoch and recovery
        (:meth:`oncekit.core.engine.CheckpointEngine.start_run`), once :meth:`refuse_claimed`
        let ``owner`` have the sink id: record ``owner``. Another query taking the id over starts
        its batch numbers again, so the previous query's batch records are dropped first
        (:meth:`reset`): they would answer for the new query's batches of the same numbers,
        which would be skipped as committed. After the epoch and recovery, and fenced at the
        target, so that nothing the previous query's drivers still do can land after the reset:
        the target refuses their acts (the new run's epoch is above theirs; a Kafka sink resets
        each writer's marker in a transaction of the writer's own id, which fences the previous
        query's producers), and the recovery committed what they had decided. A crash between the
        reset and the record resets again at the next start."""
        current = self.recorded_owner()
        if current is not None and current.query_id != owner.query_id:
            logger.info("sink %s: query %s takes the sink id over from query %s; dropping its batch records",
                        self.sink_id, owner.query_id, current.query_id)
            self.reset()
        if current != owner:
            self.record_owner(owner)

    def recorded_owner(self) -> SinkOwner | None:
        """Driver: the owner recorded in the target for this sink id; None when none is (the
        default: a target that keeps no record, where :meth:`claim` checks nothing)."""
        return None

    def record_owner(self, owner: SinkOwner) -> None:
        """Driver: record ``owner`` for this sink id in the target, replacing any other;
        FencedError when a newer run than this object's holds the target."""

    def reset(self) -> None:
        """Driver, from :meth:`claim`, when another query takes the sink id over: drop every
        record of the previous query's batches (marker rows, decisions, recorded checkpoints,
        batch markers), fenced by this run's epoch; raise when they cannot be dropped. The
        default keeps none."""

    def forget(self, before_batch: int) -> None:
        """Driver, in recovery, after the journal dropped batches Spark no longer keeps: drop the
        sink's own records of batches before ``before_batch`` (marker rows, recorded checkpoints).
        Those batches are committed and marked done, and Spark never runs them again, so nothing
        will ask about them; without this such records grow by one per batch forever. The
        default keeps nothing."""

    def close(self) -> None:
        """Release connections; called when the engine is done with the sink."""


class SinkConfig(ABC):
    """A sink's configuration: picklable, frozen, free of open connections. It travels as Spark
    string options (for ``df.writeStream.format(...)``) and builds the sink object in whichever
    process needs it: the driver's Python worker, an executor's task, or the user's driver
    process (the listener)."""

    format_name: ClassVar[str]
    sink_id: str
    protocol: str

    def _check_common(self, protocols: tuple[str, ...], target: str, default_id: str) -> None:
        """Called from a subclass's ``__post_init__``: the protocol is known, the target is given,
        and the sink id (which names transactions, journal folders and marker topics) is safe;
        without one it is derived from the target."""
        if self.protocol not in protocols:
            raise ConfigError(f"{self.format_name}: unknown protocol {self.protocol!r}; choose one of {', '.join(protocols)}")
        if not target:
            raise ConfigError(f"{self.format_name}: the target (table or topic) is required")
        if not self.sink_id:
            object.__setattr__(self, "sink_id", re.sub(r"[^A-Za-z0-9_.-]", "_", default_id))
        if not _SINK_ID.match(self.sink_id):
            raise ConfigError(f"{self.format_name}: sink id {self.sink_id!r} may hold only letters, digits, '_', '.', '-'")

    @property
    def guarantee(self) -> DeliveryGuarantee:
        return DeliveryGuarantee.AT_LEAST_ONCE if self.protocol == "at-least-once" else DeliveryGuarantee.EXACTLY_ONCE

    @abstractmethod
    def build(self, checkpoint: str) -> Sink:
        """Create the sink object for a query whose checkpoint is at ``checkpoint``."""

    @abstractmethod
    def to_options(self) -> dict[str, str]:
        """Spark string options that :meth:`from_options` turns back into this configuration."""

    @classmethod
    @abstractmethod
    def from_options(cls, options: Mapping[str, str], columns: tuple[str, ...]) -> SinkConfig:
        """Parse Spark's (lower-cased) options; ``columns`` are the stream's column names."""

    @classmethod
    @abstractmethod
    def data_source(cls) -> type:
        """The PySpark ``DataSource`` class of ``format_name``, which ``start_query`` registers.
        Imports pyspark: called only where a SparkSession exists."""

"""What the PostgreSQL sinks' protocols share: the names of the kit's tables beside the target,
and the base of the four protocol classes, which decides and leaves every statement to its
target (:mod:`oncekit.sinks.postgres._target`).

The kit's tables, in the target's schema:

- ``oncekit_sinks``: per sink id, the query (id and checkpoint) that writes through it
  (:meth:`~oncekit.core.protocol.Sink.claim`) and the epoch of its newest run
  (:meth:`PostgresSinkBase.take_epoch`): the fencing token every deciding transaction checks.
- ``oncekit_markers`` (two-phase commit): one row per committed (sink, batch, partition),
  inside the prepared transaction, so "committed" can be told from "rolled back".
- ``oncekit_decisions`` (two-phase commit): per (sink, batch, epoch), whether that run's journal
  entry of the batch is its decision (``decided``) or can never be (``vetoed``).
- ``oncekit_checkpoints`` (write-ahead log): one row per published (sink, batch).
- ``oncekit_partitions`` (idempotent): per (sink, partition), the newest batch whose rows of that
  partition are written; a task writes no batch older than the newest of any partition, so that
  an older batch's rows never overwrite a newer one's, however either run planned its tasks.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, ClassVar

from oncekit.core.errors import FencedError, OncekitError, ServiceError
from oncekit.core.protocol import Sink, SinkOwner
from oncekit.sinks.postgres._target import target_for

if TYPE_CHECKING:
    from oncekit.sinks.postgres.config import PostgresSinkConfig

logger = logging.getLogger(__name__)

FORMAT = "oncekit-postgres"
MARKER_TABLE = "oncekit_markers"
CHECKPOINT_TABLE = "oncekit_checkpoints"
DECISION_TABLE = "oncekit_decisions"
PARTITION_TABLE = "oncekit_partitions"
OWNER_TABLE = "oncekit_sinks"


def in_schema_of(table: str, other: str) -> str:
    """``other`` in the same schema as ``table``."""
    return f"{table.split('.', 1)[0]}.{other}" if "." in table else other


class PostgresSinkBase(Sink):
    """What the four protocols share: the target, the epoch register, the owner record and the
    kit's batch records. Built by ``PostgresSinkConfig.build`` in the driver's worker, a task, or
    the listener."""

    BATCH_RECORDS: ClassVar[tuple[str, ...]] = ()
    """The kit's tables beside the target where the protocol records its batches (marker rows,
    decisions, recorded checkpoints): forgotten below the oldest batch Spark keeps, dropped when
    another query takes the sink id over."""
    PARTITION_RECORDS: ClassVar[tuple[str, ...]] = ()
    """The kit's tables with a row per partition (bounded): dropped only when another query takes
    the sink id over."""

    def __init__(self, config: PostgresSinkConfig, checkpoint: str) -> None:
        self.config, self.checkpoint = config, checkpoint
        self.sink_id = config.sink_id
        self.target = target_for(config)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config!r})"

    def preflight(self, resumed: bool = False) -> None:
        """Driver, at query start: the target exists with the stream's columns and keys, and the
        kit's own tables exist."""
        self.target.preflight()

    def recorded_owner(self) -> SinkOwner | None:
        return self.target.owner()

    def take_epoch(self, floor: int) -> int:
        """Driver, at a run's start: raise the sink's row in ``oncekit_sinks`` to a new epoch
        above ``floor`` and above its own, in one statement. The row lock waits for the deciding
        transactions of older runs that hold it (their last statement and commit, bounded by the
        server's idle timeout); every later one sees the new epoch and is refused."""
        return self.target.take_epoch(self.checkpoint, floor)

    def hold_epoch(self, epoch: int) -> None:
        self.target.hold_epoch(self.checkpoint, epoch)

    def record_owner(self, owner: SinkOwner) -> None:
        self.target.record_owner(owner, self.epoch)

    def forget(self, before_batch: int) -> None:
        """Driver, in recovery: delete this sink's rows of batches before ``before_batch`` from
        its :attr:`BATCH_RECORDS` tables. They answer "committed?" only for batches recovery may
        still commit; one row per batch (and partition) would grow forever. A failure only
        delays it: the next recovery that prunes the journal deletes the same rows and newer ones."""
        for table in self.BATCH_RECORDS:
            try:
                deleted = self.target.delete_batch_records(table, before_batch, self.epoch)
                logger.info("sink %s: deleted %s rows of batches before %s from %s", self.sink_id, deleted,
                            before_batch, table)
            except OncekitError as exc:
                logger.warning("sink %s: could not delete rows of batches before %s from %s: %s", self.sink_id,
                               before_batch, table, exc)

    def reset(self) -> None:
        """Driver, from ``claim``, when another query takes the sink id over: delete all of this
        sink's rows from its :attr:`BATCH_RECORDS` and :attr:`PARTITION_RECORDS` tables, fenced by
        this run's epoch."""
        for table in (*self.BATCH_RECORDS, *self.PARTITION_RECORDS):
            try:
                deleted = self.target.delete_batch_records(table, None, self.epoch)
            except FencedError:
                raise
            except (OncekitError, OSError) as exc:
                raise ServiceError(f"{FORMAT} sink {self.sink_id}: cannot delete the previous query's rows from "
                                   f"{table}: {exc}") from exc
            logger.info("sink %s: deleted %s rows of the previous query from %s", self.sink_id, deleted, table)

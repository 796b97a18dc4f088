"""The names oncekit gives to things outside its own process, each formatted and parsed here only.

Like psycopg's ``Xid``, each is a frozen value object: ``str(name)`` is what the target sees,
``parse`` reads it back (None for a name oncekit did not make). Whoever needs one of these names
builds it from these classes; nobody else writes ``"oncekit:"`` or ``"oncekit-"``.

- :class:`TransactionId`: a PostgreSQL prepared transaction's global id,
  ``oncekit:<sink>:<batch>:<partition>:<attempt>:e<epoch>``.
- :class:`KafkaTransactionalId`: a Kafka producer's ``transactional.id``, stable per sink and
  writer (a partition, or the write-ahead log's publisher) so that a new producer fences a zombie.
- :class:`MarkerTopic`: the compacted topic that holds a Kafka sink's batch markers and the record
  of which query writes through it.
- :class:`StagedFile`: a write-ahead-log file, relative to the sink's staging folder.

The epoch in a name is the query run's that made it (its fencing token): it tells runs apart
where Spark's task attempt ids, which start again at 0 in every application, cannot. Names made
before the kit fenced runs have none and parse as epoch 0.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_TRANSACTION_ID = re.compile(
    r"oncekit:(?P<sink>[A-Za-z0-9_.-]+):(?P<batch>\d+):(?P<partition>\d+):(?P<attempt>\d+)(?::e(?P<epoch>\d+))?")
_STAGED_FILE = re.compile(r"(?P<batch>\d+)/(?P<partition>\d+)-(?P<attempt>\d+)(?:-e(?P<epoch>\d+))?\.arrow")


def _epoch_suffix(epoch: int, separator: str) -> str:
    return f"{separator}e{epoch}" if epoch else ""


@dataclass(frozen=True)
class TransactionId:
    """A prepared transaction's global id: deterministic per (sink, batch, partition, attempt,
    epoch)."""

    PREFIX = "oncekit:"

    sink_id: str
    batch_id: int
    partition_id: int
    attempt: int
    epoch: int = 0

    def __str__(self) -> str:
        return (f"{self.PREFIX}{self.sink_id}:{self.batch_id}:{self.partition_id}:{self.attempt}"
                f"{_epoch_suffix(self.epoch, ':')}")

    @classmethod
    def sink_prefix(cls, sink_id: str) -> str:
        """What every id of ``sink_id`` starts with (to list a sink's prepared transactions)."""
        return f"{cls.PREFIX}{sink_id}:"

    @classmethod
    def parse(cls, text: str) -> TransactionId | None:
        match = _TRANSACTION_ID.fullmatch(text)
        if match is None:
            return None
        return cls(match["sink"], int(match["batch"]), int(match["partition"]), int(match["attempt"]),
                   int(match["epoch"] or 0))


@dataclass(frozen=True)
class KafkaTransactionalId:
    """``oncekit-<sink>-<partition>`` for a task's producer, ``oncekit-<sink>-publisher`` for the
    write-ahead log's, ``oncekit-<sink>-owner`` for the writer of the sink's owner and epoch
    record (:meth:`owner`)."""

    sink_id: str
    partition_id: int | None = None
    role: str = "publisher"

    @classmethod
    def owner(cls, sink_id: str) -> KafkaTransactionalId:
        return cls(sink_id, None, "owner")

    def __str__(self) -> str:
        return f"oncekit-{self.sink_id}-{self.role if self.partition_id is None else self.partition_id}"


@dataclass(frozen=True)
class MarkerTopic:
    """``oncekit-markers-<sink>``: a Kafka sink's batch markers and owner record, in a compacted
    topic so that nothing expires while a pipeline is down. Partition 0 holds the owner record;
    partition ``writer + 1`` holds the markers of one writer: the transactional sink's Spark
    partition ``writer``, or the write-ahead log's publisher (writer 0). One transactional id
    writes each marker partition, so no other producer's open transaction hides its markers."""

    sink_id: str

    OWNER_PARTITION = 0

    def __str__(self) -> str:
        return f"oncekit-markers-{self.sink_id}"

    @staticmethod
    def partition_of(writer: int) -> int:
        """The partition of ``writer``'s markers."""
        return writer + 1


@dataclass(frozen=True)
class StagedFile:
    """``<batch>/<partition>-<attempt>-e<epoch>.arrow``, relative to a sink's staging folder, so
    that a checkpoint (and a savepoint of it) can move."""

    batch_id: int
    partition_id: int
    attempt: int
    epoch: int = 0

    def __str__(self) -> str:
        return f"{self.batch_id}/{self.partition_id}-{self.attempt}{_epoch_suffix(self.epoch, '-')}.arrow"

    @classmethod
    def parse(cls, text: str) -> StagedFile | None:
        match = _STAGED_FILE.fullmatch(text)
        if match is None:
            return None
        return cls(int(match["batch"]), int(match["partition"]), int(match["attempt"]), int(match["epoch"] or 0))

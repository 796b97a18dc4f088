"""What a Kafka sink's writer published last, and the batches before it: the batch marker, and
the decision a replayed batch takes from it (:meth:`BatchMarker.replayed`)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from oncekit.core.errors import FencedError, NonDeterministicReplayError, ReplayError

HISTORY = 100
"""How many batches before its latest a writer's marker remembers (about 3.5 KB)."""


@dataclass(frozen=True)
class BatchMarker:
    """What a writer published last: ``batch_id`` with ``rows`` records of ``checksum``, in the
    query run of ``epoch``; and ``earlier``, the (batch, rows, checksum) of the :data:`HISTORY`
    batches it published before, newest first, so that a replay of an older batch (an old
    savepoint restored, a checkpoint copied back) is compared with what was published, never
    skipped unseen (:meth:`replayed`). A marker of no batch (``batch_id`` -1, :meth:`empty`) is
    what a sink id taken over by another query starts from: it carries only the epoch."""

    batch_id: int
    rows: int
    checksum: str
    earlier: tuple[tuple[int, int, str], ...] = ()
    epoch: int = 0

    @classmethod
    def empty(cls, epoch: int) -> BatchMarker:
        return cls(-1, 0, "", (), epoch)

    @property
    def is_empty(self) -> bool:
        return self.batch_id < 0

    def to_bytes(self) -> bytes:
        return json.dumps({"batch": self.batch_id, "rows": self.rows, "checksum": self.checksum,
                           "earlier": [list(entry) for entry in self.earlier], "epoch": self.epoch}).encode()

    @classmethod
    def from_bytes(cls, value: bytes) -> BatchMarker:
        data = json.loads(value)
        if "batch" not in data:
            return cls.empty(int(data.get("epoch", 0)))
        earlier = tuple((int(b), int(r), str(c)) for b, r, c in data.get("earlier", ()))  # none before the field
        return cls(int(data["batch"]), int(data["rows"]), str(data["checksum"]), earlier, int(data.get("epoch", 0)))

    def then(self, batch_id: int, rows: int, checksum: str, epoch: int = 0) -> BatchMarker:
        """The marker of ``batch_id``, published after this one (by the run of ``epoch``), which
        it remembers (an empty marker has nothing to remember)."""
        earlier = () if self.is_empty else ((self.batch_id, self.rows, self.checksum), *self.earlier)[:HISTORY]
        return BatchMarker(batch_id, rows, checksum, earlier, epoch)

    def refuse_newer(self, epoch: int, where: str) -> None:
        """FencedError when this marker is a newer run's than ``epoch``: the writer's run was
        superseded, and it writes nothing."""
        if self.epoch > epoch:
            raise FencedError(f"{where}: this run (epoch {epoch}) was superseded by epoch {self.epoch}, whose marker is "
                              "the writer's latest; nothing of this is written")

    def replayed(self, batch_id: int, rows: int, checksum: str, where: str, epoch: int = 0) -> BatchMarker | None:
        """A writer whose latest marker is this one meets ``batch_id`` again, with ``rows`` records
        of ``checksum``: None when it published that batch with the same records (write nothing);
        the marker to publish it with when it never published it (a batch it had no part in,
        inside the history: the latest stays the latest). Raises NonDeterministicReplayError when
        the records differ, and ReplayError when the batch is older than what the history
        remembers, as neither can be told apart from writing a batch twice or losing it."""
        if batch_id > self.batch_id:
            return self.then(batch_id, rows, checksum, epoch)
        published = {b: (r, c) for b, r, c in ((self.batch_id, self.rows, self.checksum), *self.earlier)}
        if batch_id in published:
            if published[batch_id] != (rows, checksum):
                before_rows, before_checksum = published[batch_id]
                raise NonDeterministicReplayError(
                    f"{where}: the batch is committed with {before_rows} records (checksum {before_checksum}), but its "
                    f"replay has {rows} (checksum {checksum}); the pipeline is not deterministic, or the input or the "
                    "plan changed since, so exactly-once cannot hold")
            return None
        if batch_id < min(published):
            raise ReplayError(
                f"{where}: the checkpoint replays batch {batch_id}, but this writer has published up to batch "
                f"{self.batch_id} and remembers batches back to {min(published)} only: the checkpoint is older than the "
                "sink's output (an old savepoint restored, a checkpoint copied back), and its replay cannot be compared "
                f"with what was written. Restore a savepoint taken after batch {min(published) - 1}, or write the "
                "replay to a new sink id")
        kept = tuple(sorted([*self.earlier, (batch_id, rows, checksum)], reverse=True))[:HISTORY]
        return BatchMarker(self.batch_id, self.rows, self.checksum, kept, max(self.epoch, epoch))

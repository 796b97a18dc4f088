"""The journal beside Spark's checkpoint, and Spark's own commit log read back.

Layout under ``<checkpoint>/oncekit/<sink_id>/journal/``: ``<batch>.json`` holds the committables
the driver received for that batch; ``<batch>.done`` appears once all of them are committed.
Completion is never guessed: a batch is complete exactly when Spark has written
``<checkpoint>/commits/<batch>``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence

from oncekit.core.base import Committable
from oncekit.core.storage import delete_file, filesystem, list_names, read_bytes, write_atomically

logger = logging.getLogger(__name__)


def _batch_ids(names: list[str], suffix: str = "") -> set[int]:
    out = set()
    for name in names:
        stem = name[: -len(suffix)] if suffix and name.endswith(suffix) else (name if not suffix else "")
        if stem.isdigit():
            out.add(int(stem))
    return out


class SparkCheckpoint:
    """Read-only view of Spark's offset and commit logs for one query."""

    def __init__(self, checkpoint: str) -> None:
        self.fs, self.root = filesystem(checkpoint)

    def completed(self) -> set[int]:
        """Batch ids whose commit Spark has logged: their checkpoint is complete."""
        return _batch_ids(list_names(self.fs, f"{self.root}/commits"))

    def latest_planned(self) -> int | None:
        """The newest batch id in the offset log (planned; maybe running, maybe complete)."""
        planned = _batch_ids(list_names(self.fs, f"{self.root}/offsets"))
        return max(planned) if planned else None


class Journal:
    """What the driver has received from the tasks, per batch, for one sink. Written atomically."""

    def __init__(self, checkpoint: str, sink_id: str) -> None:
        self.fs, root = filesystem(checkpoint)
        self.directory = f"{root}/oncekit/{sink_id}/journal"
        self.sink_id = sink_id

    def _path(self, batch_id: int, suffix: str) -> str:
        return f"{self.directory}/{batch_id}{suffix}"

    def write(self, batch_id: int, committables: Sequence[Committable]) -> None:
        """Driver, in the stream writer's commit: record the batch's committables before Spark
        logs the batch as committed."""
        payload = {"sink_id": self.sink_id, "batch_id": batch_id, "committables": [c.to_dict() for c in committables]}
        write_atomically(self.fs, self._path(batch_id, ".json"), json.dumps(payload).encode())
        delete_file(self.fs, self._path(batch_id, ".done"))

    def read(self, batch_id: int) -> list[Committable]:
        payload = json.loads(read_bytes(self.fs, self._path(batch_id, ".json")))
        return [Committable.from_dict(c) for c in payload["committables"]]

    def entries(self) -> tuple[set[int], set[int]]:
        """(journaled batch ids, the ones of them marked done)."""
        names = list_names(self.fs, self.directory)
        return _batch_ids(names, ".json"), _batch_ids(names, ".done")

    def mark_done(self, batch_id: int) -> None:
        write_atomically(self.fs, self._path(batch_id, ".done"), b"")

    def delete(self, batch_id: int) -> None:
        delete_file(self.fs, self._path(batch_id, ".json"))
        delete_file(self.fs, self._path(batch_id, ".done"))

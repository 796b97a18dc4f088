"""Spark's own logs under a query's checkpoint, read back: ``commits/`` and ``offsets/``.

The only reader of them in oncekit. It goes through :mod:`oncekit.core.storage`, so it works for
local, HDFS and S3 checkpoints from any process (driver worker, listener, CLI, test harness).
Completion is never guessed: a batch is complete exactly when Spark has written
``<checkpoint>/commits/<batch>``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from oncekit.core.storage import filesystem, list_names, read_bytes


def batch_ids(names: Iterable[str], suffix: str = "") -> set[int]:
    """The batch ids among file names ``<batch><suffix>`` (others, such as temporary files, are skipped)."""
    out = set()
    for name in names:
        if suffix:
            if not name.endswith(suffix):
                continue
            name = name[: -len(suffix)]
        if name.isdigit():
            out.add(int(name))
    return out


class SparkLog:
    """Read-only view of one query's offset and commit logs."""

    def __init__(self, checkpoint: str) -> None:
        self.fs, self.root = filesystem(checkpoint)

    def completed(self) -> set[int]:
        """Batch ids whose commit Spark has logged: their checkpoint is complete."""
        return batch_ids(list_names(self.fs, f"{self.root}/commits"))

    def planned(self) -> set[int]:
        """Batch ids in the offset log (planned; maybe running, maybe complete)."""
        return batch_ids(list_names(self.fs, f"{self.root}/offsets"))

    def latest_completed(self) -> int | None:
        completed = self.completed()
        return max(completed) if completed else None

    def latest_planned(self) -> int | None:
        planned = self.planned()
        return max(planned) if planned else None

    def exists(self) -> bool:
        """Whether Spark has started this checkpoint (its offset log exists)."""
        return bool(list_names(self.fs, f"{self.root}/offsets"))

    def stateful(self) -> bool:
        """Whether the query keeps state (Spark writes ``state/`` for its stateful operators only)."""
        return bool(list_names(self.fs, f"{self.root}/state"))

    def query_id(self) -> str | None:
        """The id Spark gave the query when it first started on this checkpoint (``metadata``);
        it stays with the checkpoint, and with a savepoint's copy of it. None before that, or
        when the checkpoint is gone."""
        try:
            return str(json.loads(read_bytes(self.fs, f"{self.root}/metadata"))["id"])
        except (OSError, ValueError, KeyError):
            return None

    def source_offsets(self, batch_id: int) -> list[Any]:
        """The end offsets of every source for ``batch_id``, as the sources wrote them (a dict for
        oncekit's Kafka source, ``None`` for a source without offsets)."""
        lines = read_bytes(self.fs, f"{self.root}/offsets/{batch_id}").decode().splitlines()
        out: list[Any] = []
        for line in lines[2:]:  # version, batch metadata, then one offset per source
            try:
                out.append(json.loads(line))
            except ValueError:
                out.append(None)
        return out

    def state_partitions(self, batch_id: int | None = None) -> int | None:
        """How many partitions the query's state has at ``batch_id`` (default the latest planned
        batch): the shuffle partitions Spark fixed at the query's first batch and keeps in every
        offset log entry (only an offline repartition changes it). None before the first batch."""
        batch_id = self.latest_planned() if batch_id is None else batch_id
        if batch_id is None:
            return None
        header = read_bytes(self.fs, f"{self.root}/offsets/{batch_id}").decode().splitlines()[1]
        partitions = json.loads(header).get("conf", {}).get("spark.sql.shuffle.partitions")
        return int(partitions) if partitions is not None else None

    def records_read(self) -> int:
        """Offsets consumed by the committed batches, summed over every source partition (the
        end offsets of the latest completed batch); 0 before the first."""
        latest = self.latest_completed()
        if latest is None:
            return 0
        return sum(
            int(offset)
            for offsets in self.source_offsets(latest) if isinstance(offsets, dict)
            for partitions in offsets.values() if isinstance(partitions, dict)
            for offset in partitions.values()
        )

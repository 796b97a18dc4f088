"""The journal beside Spark's checkpoint: what the driver received from the tasks, per batch.

Layout under ``<checkpoint>/oncekit/<sink_id>/journal/``: ``<batch>.json`` holds the committables
the driver received for that batch; ``<batch>.done`` appears once all of them are committed; ``run`` names the newest query run
that has recovered (:class:`~oncekit.core.spark.writer.QueryRun`).
Whether a batch's checkpoint is complete is Spark's commit log's to say (:mod:`oncekit.core.spark_log`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence

from oncekit.core.protocol import Committable
from oncekit.core.spark_log import batch_ids
from oncekit.core.storage import delete_file, filesystem, list_names, read_bytes, temporary_target, write_atomically

logger = logging.getLogger(__name__)


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
        return batch_ids(names, ".json"), batch_ids(names, ".done")

    def mark_done(self, batch_id: int) -> None:
        write_atomically(self.fs, self._path(batch_id, ".done"), b"")

    def delete(self, batch_id: int) -> None:
        delete_file(self.fs, self._path(batch_id, ".json"))
        delete_file(self.fs, self._path(batch_id, ".done"))

    def run(self) -> str | None:
        """The token of the newest query run whose first stream writer recovered (``run``)."""
        try:
            return read_bytes(self.fs, f"{self.directory}/run").decode()
        except FileNotFoundError:
            return None

    def start_run(self, token: str) -> None:
        """Driver, the first stream writer of a query run, once it has recovered."""
        write_atomically(self.fs, f"{self.directory}/run", token.encode())

    def sweep(self, before_batch: int) -> None:
        """Driver, in recovery: delete temporaries that killed writers left for batches before
        ``before_batch`` (their entries are final or gone)."""
        for name in list_names(self.fs, self.directory):
            stem = (temporary_target(name) or "").split(".", 1)[0]
            if stem.isdigit() and int(stem) < before_batch:
                delete_file(self.fs, f"{self.directory}/{name}")

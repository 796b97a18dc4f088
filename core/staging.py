"""Staged rows of the write-ahead-log protocol: Arrow IPC files under the checkpoint.

``<checkpoint>/oncekit/<sink>/staged/`` + :class:`~oncekit.core.names.StagedFile`
(``<batch>/<partition>-<attempt>-e<epoch>.arrow``), each written atomically by one task attempt, read by
whichever process publishes the batch once its checkpoint is complete, and deleted after that
(or when the batch is aborted).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence

import pyarrow as pa

from oncekit.core.names import StagedFile
from oncekit.core.protocol import Committable, TaskInfo
from oncekit.core.storage import delete_dir, delete_dir_if_spent, delete_file, filesystem, list_names, write_atomically

logger = logging.getLogger(__name__)

_WRITE_OPTIONS = pa.ipc.IpcWriteOptions(metadata_version=pa.ipc.MetadataVersion.V5)
"""How staged files are written: Arrow's current IPC format, whatever ``ARROW_PRE_*`` variables
say (the kit alone writes and reads them). Given, pyarrow reads no environment per file."""


class StagedFiles:
    """The staging area of one sink of one query."""

    def __init__(self, checkpoint: str, sink_id: str) -> None:
        self.fs, root = filesystem(checkpoint)
        self.sink_id = sink_id
        self.directory = f"{root}/oncekit/{sink_id}/staged"

    def stage(self, task: TaskInfo, batches: Iterator[pa.RecordBatch]) -> Committable | None:
        """Task: write the partition's rows to one file; None when there were none."""
        buffer = pa.BufferOutputStream()
        writer = None
        rows = 0
        for batch in batches:
            if batch.num_rows == 0:
                continue
            if writer is None:
                writer = pa.ipc.new_stream(buffer, batch.schema, options=_WRITE_OPTIONS)
            writer.write_batch(batch)
            rows += batch.num_rows
        if writer is None:
            return None
        writer.close()
        write_atomically(self.fs, self._path(task.staged_file), buffer.getvalue().to_pybytes())
        logger.info("sink %s batch %s partition %s: staged %s rows in %s", self.sink_id, task.batch_id,
                    task.partition_id, rows, task.staged_file)
        return Committable(task.sink_id, task.batch_id, task.partition_id, task.attempt, rows,
                           staged_file=task.staged_file, epoch=task.epoch)

    def _path(self, staged_file: str | None) -> str:
        return f"{self.directory}/{staged_file}"

    def read(self, committable: Committable) -> Iterator[pa.RecordBatch]:
        with self.fs.open_input_stream(self._path(committable.staged_file)) as source:
            yield from pa.ipc.open_stream(source)

    def discard(self, committables: Sequence[Committable]) -> None:
        """Driver: delete the batch's staged files once it is aborted, and each batch folder left
        with nothing in it (a folder per batch would otherwise pile up); a replay of the batch
        may be staging its own meanwhile."""
        for committable in committables:
            delete_file(self.fs, self._path(committable.staged_file))
        for batch_id in sorted({c.batch_id for c in committables}):
            delete_dir_if_spent(self.fs, f"{self.directory}/{batch_id}")

    def drop(self, batch_id: int) -> None:
        """Driver, once the batch is published: delete its folder and every file in it. Spark
        completed the batch, so no run stages anything for it any more; the files an entry does
        not name (an older run's, a lost attempt's) are garbage as well."""
        delete_dir(self.fs, f"{self.directory}/{batch_id}")

    def leftovers(self, batch_ids: Iterable[int] | None = None) -> list[Committable]:
        """Every staged file still present, for ``batch_ids`` or all batches: a listing of each
        wanted batch's folder, after one of the staging folder when all are wanted."""
        if batch_ids is None:
            folders = [name for name in list_names(self.fs, self.directory) if name.isdigit()]
        else:
            folders = [str(batch_id) for batch_id in sorted(set(batch_ids))]
        out = []
        for name in folders:
            for file_name in list_names(self.fs, f"{self.directory}/{name}"):
                staged = StagedFile.parse(f"{name}/{file_name}")
                if staged is not None:
                    out.append(Committable(self.sink_id, staged.batch_id, staged.partition_id, staged.attempt, 0,
                                           staged_file=str(staged), epoch=staged.epoch))
        return out

"""The journal beside Spark's checkpoint: what the driver received from the tasks, per batch.

Layout under ``<checkpoint>/oncekit/<sink_id>/journal/``:

- ``<batch>.e<epoch>.json``: the committables the driver of the run of ``epoch`` received for
  that batch (``<batch>.json``: a run without an epoch). Each run writes its own file, so a run
  paused past its lease that wakes up never replaces what a newer run journaled; readers take
  the newest epoch's.
- ``<batch>.done``: all of the batch is committed; the journal never reopens such a batch.
- ``runs/e<epoch>-<token>``: each run that took an epoch (:class:`~oncekit.core.run.QueryRun`),
  so that a writer of a superseded run knows it is one (:meth:`Journal.epoch_of`,
  :meth:`Journal.latest_epoch`), and the newest run is the one with the highest epoch
  (:meth:`Journal.run`). Every run writes only its own files; nothing here is replaced by a run
  other than the one that wrote it.

An entry is what a run's driver received; whether it is the batch's decision is the sink's to say
where a pre-commit holds what a replay needs (:meth:`~oncekit.core.protocol.Sink.decided`).
Whether a batch's checkpoint is complete is Spark's commit log's to say (:mod:`oncekit.core.spark_log`).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping, Sequence

from oncekit.core.errors import CommitError
from oncekit.core.protocol import Committable
from oncekit.core.spark_log import batch_ids
from oncekit.core.storage import delete_file, filesystem, list_names, read_bytes, temporary_target, write_atomically

logger = logging.getLogger(__name__)

_ENTRY = re.compile(r"(?P<batch>\d+)(?:\.e(?P<epoch>\d+))?\.json")
_RUN = re.compile(r"e(?P<epoch>\d+)-(?P<token>.+)")
RUNS_KEPT = 20
"""Run records kept: a writer of a run older than these is refused all the same (its epoch is
below the newest)."""


class Journal:
    """What the driver has received from the tasks, per batch, for one sink. Written atomically."""

    def __init__(self, checkpoint: str, sink_id: str) -> None:
        self.fs, root = filesystem(checkpoint)
        self.directory = f"{root}/oncekit/{sink_id}/journal"
        self.sink_id = sink_id

    def _path(self, batch_id: int, suffix: str) -> str:
        return f"{self.directory}/{batch_id}{suffix}"

    def write(self, batch_id: int, committables: Sequence[Committable], epoch: int = 0,
              names: list[str] | None = None) -> None:
        """Driver, in the stream writer's commit: record the batch's committables before Spark
        logs the batch as committed, in the entry of the run of ``epoch``. A batch marked done
        (among ``names``, when the caller listed the folder this step) is never reopened: a
        replay of it that holds nothing open (its sink found it committed) journals nothing; one
        that pre-committed anything is refused (CommitError), so the batch fails and its
        pre-commits are aborted."""
        if (f"{batch_id}.done" in names if names is not None
                else self.fs.get_file_info(self._path(batch_id, ".done")).is_file):
            if not committables:
                logger.info("sink %s batch %s: committed before; the replay holds nothing open", self.sink_id, batch_id)
                return
            raise CommitError(f"sink {self.sink_id} batch {batch_id}: already committed (the journal marks it done), "
                              "by another run of this query; this run journals nothing for it")
        payload = {"sink_id": self.sink_id, "batch_id": batch_id, "epoch": epoch,
                   "committables": [c.to_dict() for c in committables]}
        write_atomically(self.fs, self._path(batch_id, f".e{epoch}.json" if epoch else ".json"),
                         json.dumps(payload).encode())

    def _entries_of(self, names: list[str]) -> dict[int, list[tuple[int, str]]]:
        """Per batch, its entries as (epoch, file name)."""
        found: dict[int, list[tuple[int, str]]] = {}
        for name in names:
            match = _ENTRY.fullmatch(name)
            if match is not None:
                found.setdefault(int(match["batch"]), []).append((int(match["epoch"] or 0), name))
        return found

    def read(self, batch_id: int) -> list[Committable]:
        """The batch's committables, as the newest run that journaled it received them."""
        entries = self.read_all(batch_id)
        if not entries:
            raise FileNotFoundError(f"{self.directory}: no journal entry of batch {batch_id}")
        return entries[max(entries)]

    def listing(self) -> list[str]:
        """The journal folder's file names, read once: an engine step that asks several questions
        of the journal passes them to each (``names``), where it would otherwise list the folder
        for each. A listing taken earlier answers as the journal was then: what another run wrote
        since is seen at the next step, as if it had come a moment later."""
        return list_names(self.fs, self.directory)

    def _names(self, names: list[str] | None) -> list[str]:
        """``names`` when the caller listed the folder this step, else the folder's names now."""
        return self.listing() if names is None else names

    def read_all(self, batch_id: int, names: list[str] | None = None) -> dict[int, list[Committable]]:
        """Every run's entry of ``batch_id``, by epoch (an entry pruned meanwhile is left out),
        among ``names`` (default: the folder's now)."""
        found: dict[int, list[Committable]] = {}
        for epoch, name in self._entries_of(self._names(names)).get(batch_id, []):
            try:
                payload = json.loads(read_bytes(self.fs, f"{self.directory}/{name}"))
            except FileNotFoundError:
                continue
            found[epoch] = [Committable.from_dict(c) for c in payload["committables"]]
        return found

    def epochs_of(self, batch_ids: set[int], names: list[str] | None = None) -> dict[int, set[int]]:
        """For each of ``batch_ids``, the epochs that journaled it (among ``names``, as :meth:`read_all`)."""
        found = self._entries_of(self._names(names))
        return {b: {epoch for epoch, _ in found.get(b, [])} for b in batch_ids}

    @staticmethod
    def stamps(times: dict[str, float]) -> tuple[dict[int, float], dict[int, float]]:
        """From the journal folder's file names and times (the status page's listing): per
        batch, when its newest entry was written, and when it was marked done."""
        written: dict[int, tuple[int, float]] = {}
        for name, stamp in times.items():
            match = _ENTRY.fullmatch(name)
            if match is not None:
                batch, epoch = int(match["batch"]), int(match["epoch"] or 0)
                if batch not in written or epoch >= written[batch][0]:
                    written[batch] = (epoch, stamp)
        done = {b: times[f"{b}.done"] for b in batch_ids(times, ".done")}
        return {b: stamp for b, (_, stamp) in written.items()}, done

    def entries(self, names: list[str] | None = None) -> tuple[set[int], set[int]]:
        """(journaled batch ids, the ones of them marked done), among ``names`` (as :meth:`read_all`)."""
        names = self._names(names)
        return set(self._entries_of(names)), batch_ids(names, ".done")

    def mark_done(self, batch_id: int) -> None:
        write_atomically(self.fs, self._path(batch_id, ".done"), b"")

    def delete(self, batch_id: int, names: list[str] | None = None) -> None:
        """Every run's entry of the batch among ``names`` (as :meth:`read_all`), then its mark:
        pruning (done, and older than anything Spark keeps), or a savepoint's copy dropping what
        Spark never completed."""
        for _, name in self._entries_of(self._names(names)).get(batch_id, []):
            delete_file(self.fs, f"{self.directory}/{name}")
        delete_file(self.fs, self._path(batch_id, ".done"))

    def run(self) -> str | None:
        """The token of the newest query run (the highest epoch taken here); None before any."""
        runs = self.runs()
        return max(runs, key=lambda token: runs[token]) if runs else None

    def runs(self) -> dict[str, int]:
        """Each recorded run's token and the epoch it took."""
        found: dict[str, int] = {}
        for name in list_names(self.fs, f"{self.directory}/runs"):
            match = _RUN.fullmatch(name)
            if match is not None:
                found[match["token"]] = max(found.get(match["token"], 0), int(match["epoch"]))
        return found

    def record_epoch(self, token: str, epoch: int) -> dict[str, int]:
        """Driver, the first stream writer of run ``token``, right after the run took ``epoch``
        (before its recovery, so that an older run's writers see it superseded as early as
        possible); forgets all but the newest :data:`RUNS_KEPT` runs. Returns the runs as listed
        after the record was written (the forgotten ones left out)."""
        write_atomically(self.fs, f"{self.directory}/runs/e{epoch}-{token}", b"")
        runs = self.runs()
        for old_token, old_epoch in sorted(runs.items(), key=lambda run: run[1])[:-RUNS_KEPT]:
            delete_file(self.fs, f"{self.directory}/runs/e{old_epoch}-{old_token}")
            del runs[old_token]
        return runs

    def epoch_of(self, token: str) -> int | None:
        """The epoch run ``token`` took; None for a run that has not started (or was forgotten)."""
        return self.runs().get(token)

    def latest_epoch(self, runs: Mapping[str, int] | None = None) -> int:
        """The newest epoch any run of this sink took here (0 when none has), among ``runs``
        when the caller listed them this step (:meth:`runs`)."""
        return max((self.runs() if runs is None else runs).values(), default=0)

    def sweep(self, before_batch: int, names: list[str] | None = None) -> None:
        """Driver, pruning: delete temporaries that killed writers left for batches before
        ``before_batch`` (their entries are final or gone), among ``names`` (as :meth:`read_all`)."""
        for name in self._names(names):
            stem = (temporary_target(name) or "").split(".", 1)[0]
            if stem.isdigit() and int(stem) < before_batch:
                delete_file(self.fs, f"{self.directory}/{name}")

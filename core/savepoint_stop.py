"""Stop-with-savepoint across processes: ``oncekit savepoint create`` asks the process running a
pipeline to stop at a batch boundary and take a savepoint, through two files beside the
pipeline's checkpoints::

    <checkpoint>/_running                  the runner's pid, while it runs
    <checkpoint>/_savepoint_request.json   {"into": ..., "name": ...}: written by the requester
                                           (``into`` a path or a URI),
                                           removed by the runner once the savepoint exists

The runner holds a :class:`StopRequests` open while it runs and polls :meth:`StopRequests.pending`
between batches; the requester calls :func:`request_savepoint`, which waits until the savepoint's
metadata appears (:func:`oncekit.core.savepoint.create` moves a savepoint into place whole).
Only a process alive on this machine (``/proc/<pid>``) counts as running.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from pyarrow.fs import LocalFileSystem

from oncekit.core import savepoint
from oncekit.core.errors import SavepointError
from oncekit.core.storage import write_atomically

__all__ = ["SavepointError", "StopRequest", "StopRequests", "request_savepoint", "running_pid"]

RUNNING = "_running"
REQUEST = "_savepoint_request.json"


@dataclass(frozen=True)
class StopRequest:
    """Stop, and save the checkpoints as savepoint ``name`` in the folder ``into``."""

    into: str
    name: str


class StopRequests:
    """The runner's side: a context manager that marks the pipeline at ``checkpoint_root`` as
    running in this process, and reads the stop requests addressed to it."""

    def __init__(self, checkpoint_root: str | Path) -> None:
        self.root = Path(checkpoint_root)
        self.running, self.request = self.root / RUNNING, self.root / REQUEST

    def __enter__(self) -> StopRequests:
        self.root.mkdir(parents=True, exist_ok=True)
        self.running.write_text(str(os.getpid()))
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.running.unlink(missing_ok=True)

    def pending(self) -> bool:
        """Whether a stop has been requested (cheap: called between batches)."""
        return self.request.exists()

    def take(self) -> StopRequest | None:
        """The pending request, if any; it stays pending until :meth:`answered`."""
        if not self.request.exists():
            return None
        wanted = json.loads(self.request.read_text())
        return StopRequest(wanted["into"], wanted["name"])

    def answered(self) -> None:
        """The savepoint is taken: the requester stops waiting once its metadata exists."""
        self.request.unlink(missing_ok=True)


def running_pid(checkpoint_root: str | Path) -> int | None:
    """The pid of the live process running the pipeline at ``checkpoint_root``, or None."""
    running = Path(checkpoint_root) / RUNNING
    pid = running.read_text().strip() if running.exists() else ""
    return int(pid) if pid.isdigit() and Path(f"/proc/{pid}").exists() else None


def request_savepoint(checkpoint_root: str | Path, into: str | Path, name: str, timeout_s: float,
                      poll_s: float = 0.5) -> savepoint.Savepoint | None:
    """Ask the pipeline running at ``checkpoint_root`` to stop with savepoint ``<into>/<name>`` and
    wait for it; None when no pipeline runs there (the caller then copies the checkpoints
    itself). Raises SavepointError when the runner has not taken it within ``timeout_s``."""
    pid = running_pid(checkpoint_root)
    if pid is None:
        return None
    folder = savepoint.location(into)
    request = {"into": folder, "name": name}
    # Whole or not at all: the runner polls for the file and must never read it half-written.
    write_atomically(LocalFileSystem(), str(Path(checkpoint_root) / REQUEST), json.dumps(request).encode())
    deadline = time.monotonic() + timeout_s
    while True:  # the savepoint appears whole (savepoint.create moves it into place) or not at all
        try:
            return savepoint.load(f"{folder}/{name}")
        except SavepointError:
            if time.monotonic() > deadline:
                raise SavepointError(f"the pipeline (pid {pid}) did not take savepoint {name} within {timeout_s} s") from None
            time.sleep(poll_s)

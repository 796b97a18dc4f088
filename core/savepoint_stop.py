"""Stop-with-savepoint across processes and hosts: ``oncekit savepoint create`` asks the driver
running a job to stop at a batch boundary and take a savepoint, through the checkpoint storage
the job's queries already share (a local folder, HDFS, S3)::

    <root>/_savepoint_request.json   {"into": ..., "name": ..., "until": ...}: written by the
                                     requester (``into`` a path or a URI; ``until`` when it stops
                                     waiting, seconds since the epoch), removed by the runner once
                                     the savepoint exists, or by the requester when it gives up; a
                                     runner ignores and removes one whose requester gave up (killed
                                     before it could remove it)

``<root>`` is the job's checkpoint root: the folder whose subfolders are its queries'
checkpoints. A job runs there while one of those queries' leases is held
(:mod:`oncekit.core.lease`: renewed by the driver wherever it runs, void once it stops renewing),
so no process table is consulted and the driver may run on any host.

The runner (``oncekit run``, ``oncekit pipeline run``) holds a :class:`StopRequests` on the
roots of its queries and polls :meth:`StopRequests.pending` between batches; the requester calls
:func:`request_savepoint`, which waits until the savepoint's metadata appears
(:func:`oncekit.core.savepoint.create` moves a savepoint into place whole).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass

from oncekit.core import savepoint
from oncekit.core.errors import SavepointError
from oncekit.core.lease import QueryLease
from oncekit.core.storage import delete_file, filesystem, read_bytes, write_atomically

__all__ = ["REQUEST", "SavepointError", "StopRequest", "StopRequests", "request_savepoint", "running_queries"]

REQUEST = "_savepoint_request.json"


@dataclass(frozen=True)
class StopRequest:
    """Stop the job whose queries are checkpointed under ``root``, and save their checkpoints as
    savepoint ``name`` in the folder ``into``."""

    root: str
    into: str
    name: str


class StopRequests:
    """The runner's side: the stop requests addressed to the checkpoint roots ``roots`` (paths or
    URIs; usually one)."""

    def __init__(self, roots: str | Sequence[str]) -> None:
        self.roots = [savepoint.location(root) for root in ([roots] if isinstance(roots, str) else roots)]

    def pending(self) -> bool:
        """Whether a stop has been requested (one small read per root: called between batches)."""
        return self.take() is not None

    def take(self) -> StopRequest | None:
        """The pending request, if any; it stays pending until :meth:`answered`."""
        for root in self.roots:
            fs, path = filesystem(f"{root}/{REQUEST}")
            try:
                wanted = json.loads(read_bytes(fs, path))
            except FileNotFoundError:
                continue
            if wanted.get("until", float("inf")) < time.time():
                _withdraw(root)  # its requester is gone: the job must not stop for nobody
                continue
            return StopRequest(root, wanted["into"], wanted["name"])
        return None

    def answered(self, request: StopRequest) -> None:
        """The savepoint is taken: the requester stops waiting once its metadata exists."""
        _withdraw(request.root)


def _withdraw(root: str) -> None:
    fs, path = filesystem(f"{root}/{REQUEST}")
    delete_file(fs, path)


def running_queries(root: str) -> list[str]:
    """The queries under the checkpoint root ``root`` whose lease a driver holds (on any host)."""
    where = savepoint.location(root)
    return [name for name in savepoint.queries_under(where) if QueryLease(f"{where}/{name}").holder() is not None]


def request_savepoint(root: str, into: str, name: str, timeout_s: float,
                      poll_s: float = 0.5) -> savepoint.Savepoint | None:
    """Ask the job running from the checkpoint root ``root`` to stop with savepoint
    ``<into>/<name>`` and wait for it; None when no driver runs there (the caller then copies the
    checkpoints itself). Raises SavepointError, and withdraws the request, when the runner has
    not taken it within ``timeout_s``."""
    where = savepoint.location(root)
    running = running_queries(where)
    if not running:
        return None
    folder = savepoint.location(into)
    fs, path = filesystem(f"{where}/{REQUEST}")
    # Whole or not at all: the runner polls for the file and must never read it half-written.
    write_atomically(fs, path, json.dumps({"into": folder, "name": name, "until": time.time() + timeout_s}).encode())
    deadline = time.monotonic() + timeout_s
    while True:  # the savepoint appears whole (savepoint.create moves it into place) or not at all
        try:
            return savepoint.load(f"{folder}/{name}")
        except SavepointError:
            if time.monotonic() > deadline:
                _withdraw(where)  # else the job's next run would stop at once
                raise SavepointError(f"the driver running {', '.join(running)} from {where} did not take savepoint "
                                     f"{name} within {timeout_s:g} s; is it an 'oncekit run' or 'oncekit pipeline run' "
                                     "driver (only those answer)?") from None
            try:
                time.sleep(poll_s)
            except BaseException:  # interrupted: withdrawn as well
                _withdraw(where)
                raise

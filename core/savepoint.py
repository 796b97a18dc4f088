"""Savepoints, as in Flink: a stopped pipeline's checkpoints copied aside with what they belong
to, to start the same pipeline again from them later, in a new checkpoint location.

A savepoint is a folder::

    <savepoints>/<name>/savepoint.json     name, time, versions, and per query: sink id,
                                           fingerprint, last committed batch
    <savepoints>/<name>/<query>/...        the query's checkpoint: offsets, commits, state,
                                           sources, metadata, and the kit's journal (oncekit/)

:func:`create` copies checkpoints of queries that are stopped (``ReferencePipeline.savepoint``
stops them at a batch boundary first). A batch that was planned but not committed is kept, so
that a restore re-runs it as a restart would; journal entries of such a batch are left out,
since what they name (prepared transactions, staged files) belongs to the original location.
:func:`restore` refuses, with :class:`SavepointError`, a savepoint whose queries, sink ids or
fingerprints differ from the pipeline's, and never writes into a checkpoint location in use.
A running pipeline is asked to stop with a savepoint through :mod:`oncekit.core.savepoint_stop`.
"""

from __future__ import annotations

import json
import logging
import platform
import re
import shutil
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

from oncekit.core.errors import SavepointError
from oncekit.core.journal import Journal
from oncekit.core.spark_log import SparkLog

__all__ = ["METADATA", "SavedQuery", "Savepoint", "SavepointError", "check_compatible", "create", "delete",
           "list_savepoints", "load", "restore"]

logger = logging.getLogger(__name__)

METADATA = "savepoint.json"
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,100}$")


@dataclass(frozen=True)
class SavedQuery:
    """One query in a savepoint."""

    name: str
    sink_id: str
    fingerprint: str
    batch_id: int | None


@dataclass(frozen=True)
class Savepoint:
    """A savepoint's metadata (``savepoint.json``) and where it is."""

    name: str
    path: str
    created_at: str
    queries: tuple[SavedQuery, ...]
    versions: Mapping[str, str]

    def describe(self) -> str:
        batches = ", ".join(f"{q.name}@{q.batch_id}" for q in self.queries)
        return f"{self.name}  {self.created_at}  {batches}"


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {"python": platform.python_version()}
    for package in ("oncekit", "pyspark"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = "unknown"
    return found


def create(checkpoint_root: str | Path, into: str | Path, name: str,
           queries: Mapping[str, Mapping[str, str]]) -> Savepoint:
    """Copy ``<checkpoint_root>/<query>`` of every query in ``queries`` (name -> ``sink_id`` and
    ``fingerprint``) to ``<into>/<name>`` and write the metadata. The queries must be stopped.
    Called by ``ReferencePipeline.savepoint`` and ``oncekit savepoint create``."""
    if not _NAME.match(name):
        raise SavepointError(f"savepoint name {name!r} may hold only letters, digits, '_', '.', '-'")
    target = Path(into) / name
    if target.exists():
        raise SavepointError(f"savepoint {name} already exists in {into}; pick another name or delete it")
    saved = []
    for query, identity in queries.items():
        source = Path(checkpoint_root) / query
        spark_log = SparkLog(str(source.absolute()))
        if not spark_log.exists():
            raise SavepointError(f"query {query} has no checkpoint at {source}; run the pipeline before a savepoint")
        latest = spark_log.latest_completed()
        saved.append(SavedQuery(query, identity["sink_id"], identity["fingerprint"], latest))
    staging = Path(into) / f".{name}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    for query, identity in queries.items():
        shutil.copytree(Path(checkpoint_root) / query, staging / query)
        _drop_uncommitted_journal(staging / query, identity["sink_id"])
    savepoint = Savepoint(name, str(target.absolute()), datetime.now(timezone.utc).isoformat(timespec="seconds"),
                          tuple(saved), _versions())
    payload = {**asdict(savepoint), "queries": [asdict(q) for q in saved]}
    payload.pop("path")
    (staging / METADATA).write_text(json.dumps(payload, indent=2))
    staging.rename(target)  # the savepoint appears whole or not at all
    logger.info("savepoint %s created at %s", name, target)
    return Savepoint(savepoint.name, str(target.absolute()), savepoint.created_at, savepoint.queries, savepoint.versions)


def _drop_uncommitted_journal(checkpoint: Path, sink_id: str) -> None:
    location = str(checkpoint.absolute())
    committed = SparkLog(location).completed()
    journal = Journal(location, sink_id)
    journaled, done = journal.entries()
    for batch_id in sorted((journaled | done) - committed):
        journal.delete(batch_id)


def load(path: str | Path) -> Savepoint:
    """The savepoint at ``path`` (a folder holding ``savepoint.json``)."""
    metadata = Path(path) / METADATA
    if not metadata.is_file():
        raise SavepointError(f"no savepoint at {path} (no {METADATA})")
    payload = json.loads(metadata.read_text())
    return Savepoint(payload["name"], str(Path(path).absolute()), payload["created_at"],
                     tuple(SavedQuery(**q) for q in payload["queries"]), payload.get("versions", {}))


def list_savepoints(directory: str | Path) -> list[Savepoint]:
    """Every savepoint in ``directory``, oldest first."""
    folder = Path(directory)
    if not folder.is_dir():
        return []
    found = [load(p) for p in folder.iterdir() if (p / METADATA).is_file()]
    return sorted(found, key=lambda s: s.created_at)


def check_compatible(savepoint: Savepoint, queries: Mapping[str, Mapping[str, str]]) -> None:
    """Raise SavepointError unless the pipeline's queries are the savepoint's: same names, same
    sink ids, same fingerprints (operators, sinks and output schemas)."""
    saved = {q.name: q for q in savepoint.queries}
    problems = []
    if set(saved) != set(queries):
        problems.append(f"queries differ: savepoint has {', '.join(sorted(saved))}, pipeline has {', '.join(sorted(queries))}")
    for name in sorted(set(saved) & set(queries)):
        if saved[name].sink_id != queries[name]["sink_id"]:
            problems.append(f"query {name}: sink id {saved[name].sink_id!r} in the savepoint, "
                            f"{queries[name]['sink_id']!r} now")
        elif saved[name].fingerprint != queries[name]["fingerprint"]:
            problems.append(f"query {name}: operators, sink or output schema changed (fingerprint "
                            f"{saved[name].fingerprint} in the savepoint, {queries[name]['fingerprint']} now)")
    if problems:
        raise SavepointError(f"savepoint {savepoint.name} does not match this pipeline: " + "; ".join(problems) +
                             ". Restore it with the pipeline configuration it was taken with, or start without it")


def restore(path: str | Path, checkpoint_root: str | Path, queries: Mapping[str, Mapping[str, str]]) -> Savepoint:
    """Check the savepoint at ``path`` against ``queries`` and copy it into the new checkpoint
    location ``checkpoint_root``, which must not exist or be empty; the pipeline then starts from
    there. Called by ``oncekit savepoint restore`` and ``ReferencePipeline.restore``."""
    savepoint = load(path)
    check_compatible(savepoint, queries)
    root = Path(checkpoint_root)
    if root.exists() and any(root.iterdir()):
        raise SavepointError(f"checkpoint location {root} is not empty; restore into a new location")
    root.mkdir(parents=True, exist_ok=True)
    for query in savepoint.queries:
        shutil.copytree(Path(path) / query.name, root / query.name)
    logger.info("savepoint %s restored into %s", savepoint.name, root)
    return savepoint


def delete(path: str | Path) -> None:
    """Remove the savepoint at ``path``."""
    load(path)  # refuse to delete a folder that is not a savepoint
    shutil.rmtree(path)

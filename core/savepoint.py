"""Savepoints, as in Flink: a stopped pipeline's checkpoints copied aside with what they belong
to, to start the same pipeline again from them later, in a new checkpoint location.

A savepoint is a folder::

    <savepoints>/<name>/savepoint.json     name, time, versions, and per query: sink id,
                                           fingerprint, last committed batch, state partitions
    <savepoints>/<name>/<query>/...        the query's checkpoint: offsets, commits, state,
                                           sources, metadata, and the kit's journal (oncekit/)

:func:`create` copies checkpoints of queries that are stopped (``ReferencePipeline.savepoint``
stops them at a batch boundary first); a query whose checkpoint shows a live driver's lease
(:mod:`oncekit.core.lease`), on this host or another, is refused. A batch that was planned but not committed is kept, so
that a restore re-runs it as a restart would; journal entries of such a batch are left out,
since what they name (prepared transactions, staged files) belongs to the original location.
Journal entries of committed batches stay, with their staged files: a write-ahead-log batch
whose checkpoint completed but whose rows were not yet published is published by the restored
pipeline's recovery.

Savepoints are relocatable: Spark's logs and state and the kit's journal hold paths relative to
the checkpoint (staged files are named relative to their sink's staging folder), so a savepoint
can be copied to another folder or file system and restored from there. Every location here is
a path or a URI that :func:`oncekit.core.storage.filesystem` reaches (local, HDFS, S3), and
copies go through pyarrow's filesystems.

:func:`restore` refuses, with :class:`SavepointError`, a savepoint whose queries, sink ids or
fingerprints differ from the pipeline's, and never writes into a checkpoint location in use.
Rescaling the restored state is Spark's (``oncekit.core.spark.state``); a running pipeline is
asked to stop with a savepoint through :mod:`oncekit.core.savepoint_stop`.
"""

from __future__ import annotations

import json
import logging
import platform
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

from pyarrow.fs import FileType, copy_files

from oncekit.core.errors import SavepointError
from oncekit.core.journal import Journal
from oncekit.core.lease import LEASE, QueryLease
from oncekit.core.protocol import SinkConfig
from oncekit.core.spark.plan import PlanRecord
from oncekit.core.spark_log import SparkLog
from oncekit.core.storage import delete_file, filesystem, list_names, read_bytes, write_atomically

__all__ = ["METADATA", "PLAN", "REPLAY_AFTER_RESTORE", "SavedQuery", "Savepoint", "SavepointError", "check_compatible", "create",
           "delete", "identify", "location", "list_savepoints", "load", "queries_under", "replay_notes", "restore"]

logger = logging.getLogger(__name__)

METADATA = "savepoint.json"
PLAN = "plan:"
"""What a fingerprint taken from a checkpoint's plan record (:func:`identify`) starts with; a
job's own fingerprints (the reference pipeline's, of operators, sink and schema) do not.
:func:`check_compatible` compares fingerprints of one kind only."""
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,100}$")


@dataclass(frozen=True)
class SavedQuery:
    """One query in a savepoint: ``batch_id`` is its last committed batch, ``state_partitions``
    the number of partitions of its state (None in savepoints older than the field)."""

    name: str
    sink_id: str
    fingerprint: str
    batch_id: int | None
    state_partitions: int | None = None


@dataclass(frozen=True)
class Savepoint:
    """A savepoint's metadata (``savepoint.json``) and where it is (a path or a URI)."""

    name: str
    path: str
    created_at: str
    queries: tuple[SavedQuery, ...]
    versions: Mapping[str, str]

    def describe(self) -> str:
        batches = ", ".join(f"{q.name}@{q.batch_id}" + (f" ({q.state_partitions} state partitions)"
                                                         if q.state_partitions else "") for q in self.queries)
        return f"{self.name}  {self.created_at}  {batches}"


def location(place: str | Path) -> str:
    """A path or URI as :mod:`oncekit.core.storage` takes it: local paths made absolute."""
    text = str(place)
    return text.rstrip("/") if "://" in text or text.startswith("file:") else str(Path(text).absolute())


def _exists(location: str) -> bool:
    fs, path = filesystem(location)
    return bool(fs.get_file_info(path).type != FileType.NotFound)


def _copy(source: str, destination: str) -> None:
    """Copy the folder ``source`` to ``destination``, across filesystems (local to HDFS...)."""
    source_fs, source_path = filesystem(source)
    destination_fs, destination_path = filesystem(destination)
    destination_fs.create_dir(destination_path, recursive=True)
    copy_files(source_path, destination_path, source_filesystem=source_fs, destination_filesystem=destination_fs)


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {"python": platform.python_version()}
    for package in ("oncekit", "pyspark"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = "unknown"
    return found


def queries_under(root: str) -> list[str]:
    """The names of the query checkpoints in the checkpoint root ``root`` (its subfolders that
    hold a Spark checkpoint), sorted."""
    where = location(root)
    fs, path = filesystem(where)
    return sorted(name for name in list_names(fs, path, folders_only=True) if SparkLog(f"{where}/{name}").exists())


def identify(checkpoint: str) -> dict[str, str]:
    """What a savepoint records of any job's query from its checkpoint alone: the sink id its
    journal is kept under and the fingerprint of its newest run's plan
    (:class:`~oncekit.core.spark.plan.PlanRecord`, after :data:`PLAN`; nothing after it when the
    session could not show the plan).
    SavepointError when the checkpoint has no oncekit journal (a query not started with
    :func:`oncekit.start_query`). Called by ``oncekit savepoint create`` and ``oncekit run``."""
    kit = f"{location(checkpoint)}/oncekit"
    fs, path = filesystem(kit)
    sink_ids = [name for name in list_names(fs, path, folders_only=True) if _exists(f"{kit}/{name}/journal")]
    if len(sink_ids) != 1:
        raise SavepointError(f"checkpoint {checkpoint}: " + (f"journals of several sinks ({', '.join(sink_ids)})" if sink_ids
                             else "no oncekit journal: a savepoint takes queries started with oncekit.start_query"))
    plan = PlanRecord(location(checkpoint)).read()
    return {"sink_id": sink_ids[0], "fingerprint": PLAN + (plan.fingerprint if plan is not None else "")}


def create(checkpoint_root: str | Path, into: str | Path, name: str,
           queries: Mapping[str, Mapping[str, str]]) -> Savepoint:
    """Copy ``<checkpoint_root>/<query>`` of every query in ``queries`` (name -> ``sink_id`` and
    ``fingerprint``) to ``<into>/<name>`` and write the metadata. The queries must be stopped.
    Called by ``ReferencePipeline.savepoint`` and ``oncekit savepoint create``."""
    if not _NAME.match(name):
        raise SavepointError(f"savepoint name {name!r} may hold only letters, digits, '_', '.', '-'")
    root, folder = location(checkpoint_root), location(into)
    target = f"{folder}/{name}"
    if _exists(target):
        raise SavepointError(f"savepoint {name} already exists in {folder}; pick another name or delete it")
    saved = []
    for query, identity in queries.items():
        spark_log = SparkLog(f"{root}/{query}")
        if not spark_log.exists():
            raise SavepointError(f"query {query} has no checkpoint at {root}/{query}; run the pipeline before a savepoint")
        holder = QueryLease(f"{root}/{query}").holder()
        if holder is not None and not holder.is_mine:
            raise SavepointError(f"query {query} is running ({holder.describe()}); a savepoint copies a stopped "
                                 "query's checkpoint only. Run 'oncekit savepoint create' where the pipeline runs "
                                 "(it stops the pipeline with the savepoint), or stop the pipeline first")
        saved.append(SavedQuery(query, identity["sink_id"], identity["fingerprint"], spark_log.latest_completed(),
                                spark_log.state_partitions()))
    staging = f"{folder}/.{name}.partial"
    fs, staging_path = filesystem(staging)
    fs.delete_dir_contents(staging_path, missing_dir_ok=True)
    for query, identity in queries.items():
        _copy(f"{root}/{query}", f"{staging}/{query}")
        _drop_uncommitted_journal(f"{staging}/{query}", identity["sink_id"])
        delete_file(fs, f"{staging_path}/{query}/{LEASE}")  # the original's, released or about to be
    created_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    payload = {"name": name, "created_at": created_at, "queries": [asdict(q) for q in saved], "versions": _versions()}
    write_atomically(fs, f"{staging_path}/{METADATA}", json.dumps(payload, indent=2).encode())
    fs.move(staging_path, filesystem(target)[1])  # the savepoint appears whole or not at all
    logger.info("savepoint %s created at %s", name, target)
    return load(target)


def _drop_uncommitted_journal(checkpoint: str, sink_id: str) -> None:
    committed = SparkLog(checkpoint).completed()
    journal = Journal(checkpoint, sink_id)
    names = journal.listing()
    journaled, done = journal.entries(names)
    for batch_id in sorted((journaled | done) - committed):
        journal.delete(batch_id, names)


def load(path: str | Path) -> Savepoint:
    """The savepoint at ``path`` (a folder holding ``savepoint.json``; a path or a URI)."""
    where = location(path)
    fs, folder = filesystem(where)
    try:
        payload = json.loads(read_bytes(fs, f"{folder}/{METADATA}"))
    except FileNotFoundError:
        raise SavepointError(f"no savepoint at {path} (no {METADATA})") from None
    return Savepoint(payload["name"], where, payload["created_at"],
                     tuple(SavedQuery(**q) for q in payload["queries"]), payload.get("versions", {}))


def list_savepoints(directory: str | Path) -> list[Savepoint]:
    """Every savepoint in ``directory``, oldest first."""
    folder = location(directory)
    fs, path = filesystem(folder)
    found = [load(f"{folder}/{name}") for name in list_names(fs, path)
             if not name.startswith(".") and _exists(f"{folder}/{name}/{METADATA}")]
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
        elif saved[name].fingerprint.startswith(PLAN) != queries[name]["fingerprint"].startswith(PLAN):
            logger.warning("query %s: the savepoint identifies it by its plan, this pipeline by its own fingerprint; "
                           "sink ids compared, operators not", name)
        elif saved[name].fingerprint != queries[name]["fingerprint"]:
            problems.append(f"query {name}: operators, sink or output schema changed (fingerprint "
                            f"{saved[name].fingerprint} in the savepoint, {queries[name]['fingerprint']} now)")
    if problems:
        raise SavepointError(f"savepoint {savepoint.name} does not match this pipeline: " + "; ".join(problems) +
                             ". Restore it with the pipeline configuration it was taken with, or start without it")


def restore(path: str | Path, checkpoint_root: str | Path,
            queries: Mapping[str, Mapping[str, str]] | None = None) -> Savepoint:
    """Check the savepoint at ``path`` against ``queries`` (when the caller knows the job's) and
    copy it into the new checkpoint location ``checkpoint_root``, which must not exist or be
    empty; the job then starts from there with the savepoint's state partitions. Called by
    ``ReferencePipeline.restore`` (which rescales the state afterwards when asked) and by
    ``oncekit savepoint restore`` (any job: no queries to check against)."""
    savepoint = load(path)
    if queries is not None:
        check_compatible(savepoint, queries)
    root = location(checkpoint_root)
    fs, root_path = filesystem(root)
    if list_names(fs, root_path):
        raise SavepointError(f"checkpoint location {root} is not empty; restore into a new location")
    for query in savepoint.queries:
        _copy(f"{savepoint.path}/{query.name}", f"{root}/{query.name}")
    logger.info("savepoint %s restored into %s", savepoint.name, root)
    return savepoint


REPLAY_AFTER_RESTORE = {
    ("oncekit-kafka-sink", "transactional"): "compared with the markers' history (100 batches): the same records are "
    "not written again, other records are refused (NonDeterministicReplayError), older batches are refused (ReplayError)",
    ("oncekit-kafka-sink", "write-ahead-log"): "compared with the markers' history (100 batches): the same records are "
    "not published again, other records are refused (NonDeterministicReplayError), older batches are refused (ReplayError)",
    ("oncekit-postgres", "write-ahead-log"): "not written again while the sink's checkpoint table records them (as "
    "long as Spark keeps their commit files, 100 batches by default), written again after that; not compared",
    ("oncekit-postgres", "two-phase-commit"): "not written again while the marker table records their partitions (as "
    "long as Spark keeps their commit files, 100 batches by default), written again after that; not compared",
    ("oncekit-postgres", "idempotent"): "written again in place: the same keys, the same rows",
}
"""What happens to the batches a sink wrote after a savepoint's last batch when the restored
pipeline replays them, per (sink format, protocol); at-least-once sinks write them again."""


def replay_notes(savepoint: Savepoint, sinks: Mapping[str, SinkConfig]) -> list[str]:
    """For ``oncekit pipeline run --from-savepoint``: per query, from which batch on the restored pipeline
    replays what its sinks (``sinks``: query name -> sink, fan-outs taken apart) may have
    written since the savepoint, and what each sink does with those batches."""
    from oncekit.core.fanout import sinks_of

    notes = []
    for query in savepoint.queries:
        config = sinks.get(query.name)
        if config is None:
            continue
        targets = sinks_of(config)
        after = "its first batch" if query.batch_id is None else f"batch {query.batch_id}"
        notes.append(f"query {query.name} resumes after {after}; batches its sinks wrote after the savepoint are:")
        for target in targets:
            what = REPLAY_AFTER_RESTORE.get((target.format_name, target.protocol), "written again")
            notes.append(f"  {target.sink_id} ({target.protocol}): {what}")
    return notes


def delete(path: str | Path) -> None:
    """Remove the savepoint at ``path``."""
    savepoint = load(path)  # refuse to delete a folder that is not a savepoint
    fs, folder = filesystem(savepoint.path)
    fs.delete_dir(folder)

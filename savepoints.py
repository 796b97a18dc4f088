"""``oncekit savepoint create|list|restore|delete``: savepoints of any job's queries, named by the
job's checkpoint root (the folder whose subfolders are its queries' checkpoints, a path or a
URI), whether the job runs under ``oncekit run``, ``oncekit pipeline run`` or is stopped.

``create`` asks a running job's driver, on whatever host, to stop with the savepoint
(:mod:`oncekit.core.savepoint_stop`); with no driver running, it copies the checkpoints itself,
each query identified from its checkpoint (:func:`oncekit.core.savepoint.identify`).
``restore`` copies a savepoint into a new checkpoint root, optionally rescaling the state; the
job then starts with its queries' checkpoints there. A tool on top of the library, called by
:mod:`oncekit.cli`.
"""

from __future__ import annotations

from datetime import datetime, timezone

from oncekit.core import savepoint as savepoints
from oncekit.core.errors import ConfigError, SavepointError
from oncekit.core.savepoint_stop import request_savepoint
from oncekit.core.spark_log import SparkLog


def create(root: str, into: str, name: str | None, timeout_s: float) -> savepoints.Savepoint:
    """Stop the job running from ``root`` with savepoint ``<into>/<name>`` (waiting up to
    ``timeout_s``), or copy the stopped job's checkpoints; ``name`` defaults to a timestamp."""
    name = name or datetime.now(timezone.utc).strftime("savepoint-%Y%m%dT%H%M%SZ")
    created = request_savepoint(root, into, name, timeout_s)
    if created is None:
        queries = savepoints.queries_under(root)
        if not queries:
            raise SavepointError(f"no query checkpoints under {root}: give the job's checkpoint root, the folder whose "
                                 "subfolders are its queries' checkpoints")
        created = savepoints.create(root, into, name, {q: savepoints.identify(f"{savepoints.location(root)}/{q}")
                                                       for q in queries})
    return created


def restore(path: str, root: str, state_partitions: int | None = None) -> savepoints.Savepoint:
    """Copy the savepoint at ``path`` into the new checkpoint root ``root``; with
    ``state_partitions``, rescale each query's state to that many partitions through Spark's
    offline repartitioning, which needs every planned batch committed (StateRescaleError or
    SavepointError say what to do otherwise)."""
    saved = savepoints.restore(path, root)
    if state_partitions is None:
        return saved
    where = savepoints.location(root)
    logs = {q.name: SparkLog(f"{where}/{q.name}") for q in saved.queries if q.state_partitions != state_partitions}
    logs = {name: log for name, log in logs.items() if log.stateful()}  # a stateless query has nothing to rescale
    if not logs:
        return saved
    from oncekit.core.spark.session import spark_session
    from oncekit.core.spark.state import repartition_state

    pending = [name for name, log in logs.items() if log.latest_planned() != log.latest_completed()]
    if pending:
        raise SavepointError(f"savepoint {saved.name}: queries {', '.join(pending)} have a batch planned and not "
                             f"committed; restored without rescaling into {where}. Run the job once from there (an "
                             "available-now trigger) and rescale with Spark's offline repartitioning, or restore without "
                             "--state-partitions")
    spark = spark_session("oncekit-savepoint")
    for name in logs:
        repartition_state(spark, f"{where}/{name}", state_partitions, name)
    return saved


def main(action: str, name: str | None, into: str, root: str | None, timeout_s: float = 300.0,
         state_partitions: int | None = None, new_root: str | None = None) -> int:
    """``oncekit savepoint ACTION``: print what was done; 0 when done. ``into`` is where the
    savepoints live, ``root`` the job's checkpoint root, ``new_root`` the root a restore copies
    into."""
    folder = into.rstrip("/")
    if action == "list":
        for found in savepoints.list_savepoints(folder):
            print(found.describe())
        return 0
    if action in ("restore", "delete") and not name:
        raise ConfigError(f"savepoint {action}: give the savepoint's name (oncekit savepoint list shows them)")
    if action == "delete":
        savepoints.delete(f"{folder}/{name}")
        print(f"deleted savepoint {name}")
        return 0
    if action == "restore":
        if not new_root:
            raise ConfigError("savepoint restore: give --into, the new checkpoint root to restore into")
        restored = restore(f"{folder}/{name}", new_root, state_partitions)
        scale = f" with {state_partitions} state partitions" if state_partitions else ""
        print(f"restored {restored.name} into {savepoints.location(new_root)}{scale}: start the job with its queries' "
              f"checkpoints there ({', '.join(q.name for q in restored.queries)})")
        return 0
    if not root:
        raise ConfigError(f"savepoint {action}: give --checkpoint-root, the job's checkpoint root (the folder whose "
                          "subfolders are its queries' checkpoints)")
    created = create(root, folder, name, timeout_s)
    print(f"savepoint {created.name} at {created.path}: {created.describe()}")
    return 0

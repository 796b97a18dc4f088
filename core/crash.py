"""Named crash points for failure tests.

A test arms a point by writing a file ``<ONCEKIT_CRASH_DIR>/<point>`` (see :func:`arm`); the
first process that reaches the point with a matching batch (and partition) renames the file to
``<point>.fired`` and exits at once with :data:`CRASH_EXIT_CODE`, as a killed process would.
Renaming makes it fire exactly once, whichever task, worker or driver gets there first.

Without ``ONCEKIT_CRASH_DIR`` in the environment (read once, at import) a crash point is one
``None`` check.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from oncekit.core.errors import ConfigError

logger = logging.getLogger(__name__)

CRASH_EXIT_CODE = 86
CRASH_DIR_ENV = "ONCEKIT_CRASH_DIR"

POINTS = (
    "task_before_write",       # a task, before it writes anything
    "task_after_pre_commit",   # a task, after its transaction is prepared / rows staged
    "driver_after_journal",    # the driver commit, after the journal write, before Spark's commit log
    "before_notify",           # after Spark's commit log, before the checkpoint-complete commit
    "mid_commit",              # committing a checkpoint, after some but not all of it
)

_DIRECTORY = os.environ.get(CRASH_DIR_ENV) or None


def crash_point(name: str, batch_id: int, partition_id: int | None = None) -> None:
    """Called by the engine at each named point; exits the process if the point is armed for it."""
    if _DIRECTORY is None:
        return
    armed = Path(_DIRECTORY) / name
    try:
        condition = json.loads(armed.read_text() or "{}")
    except FileNotFoundError:
        return
    if condition.get("batch") not in (None, batch_id):
        return
    if condition.get("partition") not in (None, partition_id) and partition_id is not None:
        return
    fired_file = armed.with_name(name + ".fired")
    try:
        armed.rename(fired_file)
    except FileNotFoundError:  # another process fired it first
        return
    fired_file.write_text(json.dumps({"batch": batch_id, "partition": partition_id, "pid": os.getpid()}))
    logger.warning("crash point %s fired at batch %s partition %s (pid %s)", name, batch_id, partition_id, os.getpid())
    os._exit(CRASH_EXIT_CODE)


def arm(directory: str | Path, name: str, batch_id: int | None = None, partition_id: int | None = None) -> None:
    """Test helper: arm ``name`` to fire once at ``batch_id`` (any batch if None)."""
    if name not in POINTS:
        raise ConfigError(f"unknown crash point {name!r}; known: {', '.join(POINTS)}")
    Path(directory).mkdir(parents=True, exist_ok=True)
    (Path(directory) / f"{name}.fired").unlink(missing_ok=True)  # an earlier firing is not this one's
    (Path(directory) / name).write_text(json.dumps({"batch": batch_id, "partition": partition_id}))


def fired(directory: str | Path) -> list[str]:
    """Test helper: the points that have fired."""
    return sorted(p.name[: -len(".fired")] for p in Path(directory).glob("*.fired"))


def fired_at(directory: str | Path, name: str) -> dict[str, int | None] | None:
    """Where ``name`` fired (batch, partition, pid), or None if it has not (yet)."""
    try:
        text = (Path(directory) / f"{name}.fired").read_text()
    except FileNotFoundError:
        return None
    try:
        return dict(json.loads(text or "{}"))
    except ValueError:  # renamed, not yet written
        return {"batch": None, "partition": None, "pid": None}


def disarm(directory: str | Path, name: str) -> bool:
    """Remove an armed point that has not fired; True if there was one."""
    try:
        (Path(directory) / name).unlink()
        return True
    except FileNotFoundError:
        return False

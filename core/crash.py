"""Named crash points for failure tests.

A test arms a point by writing a file ``<ONCEKIT_CRASH_DIR>/<point>`` (see :func:`arm`); the
first process that reaches the point with a matching batch (and partition) renames the file to
``<point>.fired`` and exits at once with :data:`CRASH_EXIT_CODE`, as a killed process would.
Renaming makes it fire exactly once, whichever task, worker or driver gets there first.

A point armed with ``hold=True`` does not exit: the process that reaches it waits there until
the test calls :func:`release` (at most :data:`HOLD_LIMIT_S`), then goes on. A test uses the
pause to break a service at that exact step (kill -9 a database server between two
``COMMIT PREPARED``), and the released process meets the broken service as it would have.

Without ``ONCEKIT_CRASH_DIR`` in the environment (read once, at import) a crash point is one
``None`` check.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from oncekit.core.errors import ConfigError

logger = logging.getLogger(__name__)

CRASH_EXIT_CODE = 86
HOLD_LIMIT_S = 600.0  # a held process goes on by itself after this: a test that died must not hang it
CRASH_DIR_ENV = "ONCEKIT_CRASH_DIR"

POINTS = (
    "task_before_write",       # a task, before it writes anything
    "task_after_pre_commit",   # a task, after its transaction is prepared / rows staged
    "driver_after_journal",    # the driver commit, after the journal write, before Spark's commit log
    "before_notify",           # after Spark's commit log, before the checkpoint-complete commit
    "mid_commit",              # committing a checkpoint, after some but not all of it
)

SERVICE_POINTS = (
    "kafka_commit",            # a Kafka sink, its transaction's marker and records sent, before it commits
)
"""Points inside a sink's exchange with its service, where a service fault hits (armed to hold
while the harness breaks the service); random schedules draw only from :data:`POINTS`."""

FAILURE_POINTS = (
    "driver_abort",            # Spark's abort of a failed batch, on the driver, before anything is aborted
)
"""Points reached only after a batch failed, where a fencing test holds (pauses) a driver."""

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
    if condition.get("hold"):
        logger.warning("crash point %s holding batch %s partition %s (pid %s)", name, batch_id, partition_id, os.getpid())
        released = armed.with_name(name + ".release")
        deadline = time.monotonic() + HOLD_LIMIT_S
        while not released.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        released.unlink(missing_ok=True)
        return
    logger.warning("crash point %s fired at batch %s partition %s (pid %s)", name, batch_id, partition_id, os.getpid())
    os._exit(CRASH_EXIT_CODE)


def arm(directory: str | Path, name: str, batch_id: int | None = None, partition_id: int | None = None,
        hold: bool = False) -> None:
    """Test helper: arm ``name`` to fire once at ``batch_id`` (any batch if None): exit there,
    or with ``hold`` wait there until :func:`release`."""
    known = POINTS + SERVICE_POINTS + FAILURE_POINTS
    if name not in known:
        raise ConfigError(f"unknown crash point {name!r}; known: {', '.join(known)}")
    Path(directory).mkdir(parents=True, exist_ok=True)
    for stale in (f"{name}.fired", f"{name}.release"):  # an earlier firing is not this one's
        (Path(directory) / stale).unlink(missing_ok=True)
    (Path(directory) / name).write_text(json.dumps({"batch": batch_id, "partition": partition_id, "hold": hold}))


def release(directory: str | Path, name: str) -> None:
    """Test helper: let the process held at ``name`` go on."""
    (Path(directory) / f"{name}.release").touch()


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

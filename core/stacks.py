"""Where a process tree is waiting: the Python stacks of a driver and of every process under it
(its Spark JVM's Python workers), by ``py-spy dump``, and the JVM's query and task threads, by
``jstack``. Called by the batch watchdog when a batch stalls (its own process) and by the fault
harness (a driver process it watches). Linux only (``/proc``); what a tool cannot give is left
out, so a machine without py-spy or a JDK gets what the other gives, or this process's own
Python stacks.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import traceback
from pathlib import Path

DUMP_S = 20.0
"""How long one process's dump may take."""


def process_stacks(root: int) -> str:
    """Stacks of ``root`` and every process descended from it, one section per process."""
    spy = shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))
    jstack = shutil.which("jstack") or shutil.which("jstack", path=os.path.join(os.environ.get("JAVA_HOME", ""), "bin"))
    dumps = []
    for pid in process_tree(root):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        head = f"--- pid {pid} ({_state(pid)}): {command[:160]}"
        try:
            if "java" in command.split(" ", 1)[0] and jstack is not None:
                dumped = subprocess.run([jstack, str(pid)], capture_output=True, text=True, timeout=DUMP_S)
                dumps.append(f"{head}\n{spark_threads(dumped.stdout or dumped.stderr)}")
            elif ("python" in command or not command) and spy is not None:
                dumped = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=DUMP_S)
                dumps.append(f"{head}\n{dumped.stdout or dumped.stderr}")
            elif pid == os.getpid():
                dumps.append(f"{head}\n{own_stacks()}")
        except (OSError, subprocess.TimeoutExpired) as exc:
            dumps.append(f"{head}\n(no dump: {exc})")
    return "\n".join(dumps)


def own_stacks() -> str:
    """This process's Python threads, without any tool."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    return "\n".join(f"Thread {names.get(ident, ident)}:\n{''.join(traceback.format_stack(frame))}"
                     for ident, frame in sys._current_frames().items())


def process_tree(root: int) -> list[int]:
    """``root`` and every process descended from it (Linux /proc). By parentage, not process
    group: pyspark's worker daemon puts itself and its workers in a group of their own."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parent = int(stat[stat.rindex(")") + 2:].split()[1])  # after "pid (comm) ": state ppid ...
        children.setdefault(parent, []).append(int(entry.name))
    found, pending = [], [root]
    while pending:
        pid = pending.pop()
        found.append(pid)
        pending += children.get(pid, [])
    return sorted(found)


def _state(pid: int) -> str:
    """A process's state letter from /proc (Z: a zombie nobody reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "gone"
    return stat[stat.rindex(")") + 2:].split()[0]


def spark_threads(dump: str) -> str:
    """The threads of a jstack dump that run a streaming query or a task, or talk to Python."""
    wanted = ("stream execution thread", "Executor task launch", "stdout writer", "python", "Python")
    blocks = dump.split("\n\n")
    kept = [b for b in blocks if b.startswith('"') and any(w in b.split("\n", 1)[0] or w in b for w in wanted)]
    return "\n\n".join(kept) if kept else dump[:4000]


def log_tail(log: Path, lines: int) -> str:
    """The last ``lines`` of the process log ``log``, joined by " | " (empty if it cannot be read):
    what a service or driver process printed before it exited, for the error that names it."""
    try:
        return " | ".join(log.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return ""

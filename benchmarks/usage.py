"""The CPU and memory a case uses: what its records/s per core and its peak Python worker
memory are computed from.

A case's pipeline runs in this process and its descendants: Spark's JVM and its Python workers,
or the peer's own process (Quix Streams, Kafka Streams, Flink). The services are not counted: the
local backend starts them in sessions of their own, and containers run outside this process tree.
Linux only (/proc).
"""

from __future__ import annotations

import os
import threading
from collections import defaultdict

TICKS = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


def _stat(pid: str) -> tuple[int, int, int] | None:
    """(parent, session, CPU ticks with those of its reaped children) of a process, or None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            text = stat.read()
    except OSError:
        return None
    # After the command's closing parenthesis: state, ppid, pgrp, session, ... utime (14th field),
    # stime, cutime, cstime.
    fields = text[text.rindex(")") + 2:].split()
    return int(fields[1]), int(fields[3]), sum(int(f) for f in fields[11:15])


def _tree() -> dict[int, tuple[int, int, int]]:
    """This process and its descendants in its session: pid -> its :func:`_stat`."""
    root = os.getpid()
    stats = {int(pid): stat for pid in os.listdir("/proc") if pid.isdigit() and (stat := _stat(pid)) is not None}
    children: dict[int, list[int]] = defaultdict(list)
    for pid, (parent, _, _) in stats.items():
        children[parent].append(pid)
    tree, todo = {}, [root]
    while todo:
        pid = todo.pop()
        tree[pid] = stats[pid]
        todo += [child for child in children[pid] if stats[child][1] == stats[root][1]]
    return tree


def cpu_seconds() -> float:
    """User and system CPU seconds of this process and its descendants in its session, children
    that ended and were waited for included (their parents' cutime and cstime): the difference of
    two calls is the CPU used between them."""
    return sum(ticks for _, _, ticks in _tree().values()) / TICKS


def _python_worker_bytes() -> int:
    """The largest resident memory of one Python process below Spark's JVM (its workers, and the
    per-query processes of Python data sources); 0 if there is none."""
    tree, largest = _tree(), 0
    for pid in tree:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as cmd:
                argv = cmd.read().split(b"\0")
            with open(f"/proc/{pid}/statm") as statm:
                resident = int(statm.read().split()[1]) * PAGE
        except OSError:
            continue
        # python -m pyspark.daemon, its forks, the data sources' runners (not the JVM: its class path names pyspark)
        if b"python" in os.path.basename(argv[0]) and any(b"pyspark" in arg for arg in argv[1:]):
            largest = max(largest, resident)
    return largest


class PeakWorkerMemory(threading.Thread):
    """While its ``with`` block runs, samples every ``every_s`` the resident memory of the largest
    Python worker (a task holds its partition in one); ``peak_mb`` is the largest sample."""

    def __init__(self, every_s: float = 0.1) -> None:
        super().__init__(name="peak-worker-memory", daemon=True)
        self.every_s, self.peak_mb = every_s, 0.0
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.wait(self.every_s):
            self.peak_mb = max(self.peak_mb, _python_worker_bytes() / 2**20)

    def __enter__(self) -> PeakWorkerMemory:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self.join()

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


def _stat(pid: str) -> tuple[int, int, int, int] | None:
    """(parent, session, start time, CPU ticks of its own) of a process, or None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            text = stat.read()
    except OSError:
        return None
    # After the command's closing parenthesis: state (field 3), ppid, pgrp, session, ... utime
    # (field 14), stime, ..., starttime (field 22).
    fields = text[text.rindex(")") + 2:].split()
    return int(fields[1]), int(fields[3]), int(fields[19]), int(fields[11]) + int(fields[12])


def _tree() -> dict[int, tuple[int, int, int, int]]:
    """This process and its descendants in its session: pid -> its :func:`_stat`."""
    root = os.getpid()
    stats = {int(pid): stat for pid in os.listdir("/proc") if pid.isdigit() and (stat := _stat(pid)) is not None}
    children: dict[int, list[int]] = defaultdict(list)
    for pid, (parent, *_) in stats.items():
        children[parent].append(pid)
    tree, todo = {}, [root]
    while todo:
        pid = todo.pop()
        tree[pid] = stats[pid]
        todo += [child for child in children[pid] if stats[child][1] == stats[root][1]]
    return tree


class Usage(threading.Thread):
    """While its ``with`` block runs, samples this process's tree every ``every_s``:
    ``cpu_seconds`` is the CPU its processes used in the block, ``peak_worker_mb`` (with
    ``memory``) the largest resident memory of one Python worker (a task holds its partition in
    one).

    CPU is counted per process, from its own ticks when first seen (or at the block's start) to
    its last sample, so a process that ends or leaves the tree keeps what it used until then: a
    single before-and-after sum lost a Spark Python worker's whole CPU when Spark ended it while
    an unrelated case ran (Quix Streams' row once showed -0.0 cores used). A process that lives
    less than ``every_s`` is missed; the pipelines' processes live the whole run."""

    def __init__(self, memory: bool = False, every_s: float = 0.25) -> None:
        super().__init__(name="usage", daemon=True)
        self.memory, self.every_s = memory, every_s
        self.peak_worker_mb = 0.0
        self._first: dict[tuple[int, int], int] = {}
        self._last: dict[tuple[int, int], int] = {}
        self._done = threading.Event()

    @property
    def cpu_seconds(self) -> float:
        return sum(ticks - self._first.get(key, 0) for key, ticks in self._last.items()) / TICKS

    def _sample(self, first: bool = False) -> None:
        tree = _tree()
        for pid, (_, _, started, ticks) in tree.items():
            if first:
                self._first[(pid, started)] = ticks
            self._last[(pid, started)] = ticks
        if self.memory:
            self.peak_worker_mb = max(self.peak_worker_mb, _python_worker_bytes(tree) / 2**20)

    def run(self) -> None:
        while not self._done.wait(self.every_s):
            self._sample()

    def __enter__(self) -> Usage:
        self._sample(first=True)
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self.join()
        self._sample()


def _python_worker_bytes(tree: dict[int, tuple[int, int, int, int]]) -> int:
    """The largest resident memory of one Python process of ``tree`` below Spark's JVM (its
    workers, and the per-query processes of Python data sources); 0 if there is none."""
    largest = 0
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

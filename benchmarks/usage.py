"""The CPU a case uses: what its records/s per core is computed from.

A case's pipeline runs in this process and its descendants: Spark's JVM and its Python workers,
or the peer's own process (Quix Streams, Kafka Streams, Flink). The services are not counted: the
local backend starts them in sessions of their own, and containers run outside this process tree.
Linux only (/proc).
"""

from __future__ import annotations

import os
from collections import defaultdict

TICKS = os.sysconf("SC_CLK_TCK")


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


def cpu_seconds(root: int | None = None) -> float:
    """User and system CPU seconds of ``root`` (default: this process) and its descendants in its
    session, children that ended and were waited for included (their parents' cutime and cstime):
    the difference of two calls is the CPU used between them."""
    root = os.getpid() if root is None else root
    stats = {int(pid): stat for pid in os.listdir("/proc") if pid.isdigit() and (stat := _stat(pid)) is not None}
    if root not in stats:
        return 0.0
    children: dict[int, list[int]] = defaultdict(list)
    for pid, (parent, _, _) in stats.items():
        children[parent].append(pid)
    session, ticks, todo = stats[root][1], 0, [root]
    while todo:
        pid = todo.pop()
        ticks += stats[pid][2]
        todo += [child for child in children[pid] if stats[child][1] == session]
    return ticks / TICKS

"""Resident memory of a driver process and what runs under it, read from /proc: the soak's gauges
(:mod:`oncekit.verify.soak`)."""

from __future__ import annotations

import os
from pathlib import Path


def driver_memory(driver_pid: int | None) -> tuple[float, float, float]:
    """Resident MB of the driver process, of its JVM, and of the JVM's Python workers, from /proc
    (zeros where /proc has no such processes, or the driver is not running)."""
    if driver_pid is None:
        return 0.0, 0.0, 0.0
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    jvms = [pid for pid in children.get(driver_pid, []) if _command(pid).startswith("java")]
    workers: list[int] = []
    frontier = list(jvms)
    while frontier:
        pid = frontier.pop()
        for child in children.get(pid, []):
            workers.append(child)
            frontier.append(child)
    return _rss_mb([driver_pid]), _rss_mb(jvms), _rss_mb(workers)


def _command(pid: int) -> str:
    try:
        return os.path.basename(Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode())
    except OSError:
        return ""


def _rss_mb(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return round(total / 1024, 1)

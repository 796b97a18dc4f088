"""The faults a campaign injects, and the reproducible schedule drawn from a seed."""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass

from oncekit.core.crash import POINTS

SERVICE_FAULTS = ("kafka-restart", "postgres-restart", "kafka-cut", "postgres-cut")
POSTGRES_FAULTS = {  # kind: what the table says; injected at a sink step (oncekit.verify.pgfaults)
    "postgres-kill-prepare": "postgres kill -9 in PREPARE TRANSACTION",
    "postgres-kill-commit-prepared": "postgres kill -9 between COMMIT PREPAREDs",
    "postgres-terminate": "postgres sessions terminated mid-write",
    "postgres-restart-batch": "postgres restarted mid-write",
}


@dataclass(frozen=True)
class Fault:
    """One injected failure. ``kind``: ``crash`` (``point`` armed for the next batch that reaches
    it), ``kill`` (SIGKILL of the driver ``delay_s`` after the chunk is produced), or
    ``<service>-restart`` / ``<service>-cut`` (stopped, or cut off the network, ``delay_s`` after
    the chunk is produced, for ``outage_s``), or one of :data:`POSTGRES_FAULTS` (at the sink's
    step, the server down for ``outage_s`` where it goes down)."""

    kind: str
    point: str | None = None
    delay_s: float = 0.0
    outage_s: float = 0.0

    def __str__(self) -> str:
        if self.kind == "crash":
            task = " (task retried by Spark)" if (self.point or "").startswith("task_") else ""
            return f"crash {self.point}{task}"
        if self.kind == "kill":
            return f"kill -9 driver after {self.delay_s:.1f} s"
        if self.kind in POSTGRES_FAULTS:
            down = f" {self.outage_s:.0f} s" if self.kind != "postgres-terminate" else ""
            return POSTGRES_FAULTS[self.kind] + down
        service, _, action = self.kind.partition("-")
        what = "stopped" if action == "restart" else "cut off network"
        return f"{service} {what} {self.outage_s:.0f} s"


def schedule(seed: int, count: int, points: Iterable[str] = POINTS, network_cuts: bool = True) -> list[Fault]:
    """A reproducible fault schedule: about half crash points, a tenth driver kills, a third
    service faults (network cuts only where the backend can make them)."""
    rng = random.Random(seed)
    points = tuple(points)
    services = [k for k in SERVICE_FAULTS if network_cuts or not k.endswith("-cut")]
    faults = []
    for _ in range(count):
        draw = rng.random()
        if draw < 0.55:
            faults.append(Fault("crash", point=rng.choice(points)))
        elif draw < 0.65:
            faults.append(Fault("kill", delay_s=round(rng.uniform(0.2, 3.0), 1)))
        else:
            faults.append(Fault(rng.choice(services), delay_s=round(rng.uniform(0.0, 1.5), 1),
                                outage_s=round(rng.uniform(1.0, 6.0))))
    return faults

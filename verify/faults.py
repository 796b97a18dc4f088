"""The faults a campaign injects, and the reproducible schedule drawn from a seed."""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass

from oncekit.core.crash import POINTS

SERVICE_FAULTS = ("kafka-restart", "postgres-restart", "kafka-kill", "postgres-kill", "kafka-cut", "postgres-cut")
"""A whole service: stopped (Kafka SIGTERM, PostgreSQL fast shutdown), killed -9, or cut off the
network, for ``outage_s``; see :meth:`~oncekit.connectors.services.base.Service.outage`."""
OUTAGES = {"restart": "stop", "kill": "kill", "cut": "cut"}  # kind's action: Service.outage's
POSTGRES_FAULTS = {  # kind: what the table says; injected at a sink step (oncekit.verify.pgfaults)
    "postgres-kill-prepare": "postgres kill -9 in PREPARE TRANSACTION",
    "postgres-kill-commit-prepared": "postgres kill -9 between COMMIT PREPAREDs",
    "postgres-terminate": "postgres sessions terminated mid-write",
    "postgres-restart-batch": "postgres restarted mid-write",
}

CLUSTER_FAULTS = {  # kind: what the table says; one member of a cluster (oncekit.verify.clusterfaults)
    "kafka-leader-kill": "kafka kill -9 partition leader",
    "kafka-coordinator-kill": "kafka kill -9 txn coordinator in commit",
    "kafka-rolling-restart": "kafka rolling restart of all brokers",
    "kafka-broker-cut": "kafka partition leader cut off",
    "spark-executor-kill": "spark kill -9 executor mid-batch",
}
KAFKA_CLUSTER_FAULTS = tuple(kind for kind in CLUSTER_FAULTS if kind.startswith("kafka-"))


@dataclass(frozen=True)
class Fault:
    """One injected failure. ``kind``: ``crash`` (``point`` armed for the next batch that reaches
    it), ``kill`` (SIGKILL of the driver ``delay_s`` after the chunk is produced), or
    ``<service>-restart`` / ``<service>-cut`` (stopped, or cut off the network, ``delay_s`` after
    the chunk is produced, for ``outage_s``), or one of :data:`POSTGRES_FAULTS` (at the sink's
    step, the server down for ``outage_s`` where it goes down), or one of :data:`CLUSTER_FAULTS`
    (one broker of a Kafka cluster, down or cut off for ``outage_s``; an executor of a Spark
    standalone cluster)."""

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
        if self.kind in CLUSTER_FAULTS:
            timed = self.kind in ("kafka-leader-kill", "kafka-coordinator-kill", "kafka-broker-cut")
            return CLUSTER_FAULTS[self.kind] + (f" {self.outage_s:.0f} s" if timed else "")
        if self.kind in POSTGRES_FAULTS:
            down = f" {self.outage_s:.0f} s" if self.kind != "postgres-terminate" else ""
            return POSTGRES_FAULTS[self.kind] + down
        service, _, action = self.kind.partition("-")
        what = {"restart": "stopped", "kill": "killed -9", "cut": "cut off network"}[action]
        return f"{service} {what} {self.outage_s:.0f} s"


def schedule(seed: int, count: int, points: Iterable[str] = POINTS, network_cuts: bool = True,
             kafka_cluster: bool = False, postgres_steps: Iterable[str] = (), services_only: bool = False,
             kafka: bool = True, postgres: bool = True) -> list[Fault]:
    """A reproducible fault schedule: about half crash points, a tenth driver kills, a third
    service faults (network cuts only where the backend can make them); ``services_only``: service
    faults only, the ones that hit a running batch's reads, writes and commits. With
    ``kafka_cluster`` (three brokers or more, and a sink that writes to Kafka) two service faults
    in three hit one broker (:data:`KAFKA_CLUSTER_FAULTS`), down or cut off long enough (3-15 s)
    for the cluster to notice (a broker's session times out after 9 s) or not. ``postgres_steps``
    (kinds of :data:`POSTGRES_FAULTS` the pipeline's sink reaches, see :func:`postgres_steps`)
    take half of the service faults that remain. ``kafka`` / ``postgres``: whether the pipeline
    uses that service at all (its source is Kafka; a service it does not use is not faulted)."""
    rng = random.Random(seed)
    points = tuple(points)
    services = [k for k in SERVICE_FAULTS if (network_cuts or not k.endswith("-cut"))
                and (kafka or not k.startswith("kafka")) and (postgres or not k.startswith("postgres"))]
    brokers = [k for k in KAFKA_CLUSTER_FAULTS if network_cuts or not k.endswith("-cut")] if kafka_cluster else []
    steps = list(postgres_steps)
    faults = []
    for _ in range(count):
        draw = 1.0 if services_only else rng.random()
        if draw < 0.55:
            faults.append(Fault("crash", point=rng.choice(points)))
        elif draw < 0.65:
            faults.append(Fault("kill", delay_s=round(rng.uniform(0.2, 3.0), 1)))
        elif brokers and rng.random() < 0.67:
            faults.append(Fault(rng.choice(brokers), delay_s=round(rng.uniform(0.0, 1.5), 1),
                                outage_s=round(rng.uniform(3.0, 15.0))))
        elif steps and rng.random() < 0.5:
            faults.append(Fault(rng.choice(steps), outage_s=round(rng.uniform(1.0, 4.0))))
        else:
            faults.append(Fault(rng.choice(services), delay_s=round(rng.uniform(0.0, 1.5), 1),
                                outage_s=round(rng.uniform(1.0, 6.0))))
    return faults


def postgres_steps(kind: str, protocol: str | None) -> tuple[str, ...]:
    """The :data:`POSTGRES_FAULTS` a pipeline reaches: none without a table (``kind`` kafka);
    the kills in PREPARE and between COMMIT PREPAREDs only with two-phase commit (``protocol``
    of one of the kit's examples; None for a user's pipeline, whose protocol is not known)."""
    if kind == "kafka":
        return ()
    prepares = protocol is not None and "two-phase-commit" in protocol
    return tuple(k for k in POSTGRES_FAULTS if prepares or k in ("postgres-terminate", "postgres-restart-batch"))

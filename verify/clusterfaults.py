"""Faults that hit one member of a cluster, for the campaign (:mod:`oncekit.verify.campaign`): a
broker of a Kafka cluster (three brokers or more, replication factor 3, ``min.insync.replicas``
2), an executor of a Spark standalone cluster.

- ``kafka-leader-kill``: kill -9 of the broker that leads partition 0 of the topic the sink
  writes, ``delay_s`` after the chunk is produced; started again after ``outage_s``.
- ``kafka-coordinator-kill``: the sink's next Kafka commit is held at the ``kafka_commit`` crash
  point (its marker and records sent, the commit not yet asked for); the coordinator of the
  transaction left open there is found with Kafka's DescribeTransactions and killed -9; then the
  sink goes on, so that its commit meets the dead coordinator and must find the new one (the
  leader the controller elects for its partition of the transaction log, once the killed
  broker's session times out). The broker starts again after ``outage_s``.
- ``kafka-rolling-restart``: every broker in turn stopped (controlled shutdown) and started, the
  next one only once no partition is under-replicated, as an operator's rolling upgrade goes.
- ``kafka-broker-cut``: the leader of partition 0 cut off the cluster's network (from the other
  brokers and from clients alike) for ``outage_s``.
- ``spark-executor-kill``: kill -9 of an executor JVM of the standalone cluster (its Python
  workers lose their parent) while a batch runs; the worker starts a new executor and Spark runs
  the lost tasks again.

Every broker fault starts from a healthy cluster: before the chunk is produced the harness waits
until no partition is under-replicated, so faults do not pile up below the minimum ISR.
"""

from __future__ import annotations

import logging
import os
import signal
import time

from oncekit.connectors.kafka_admin import partition_leader, under_replicated
from oncekit.connectors.services.base import KafkaService
from oncekit.connectors.services.spark_cluster import StandaloneCluster
from oncekit.core.crash import arm, disarm, fired_at, release
from oncekit.core.errors import VerifyError
from oncekit.core.spark_log import SparkLog
from oncekit.status.kafka_transactions import open_transactions
from oncekit.verify.faults import CLUSTER_FAULTS, Fault

logger = logging.getLogger(__name__)

HOLD_POINT = "kafka_commit"
REACH_S = 180.0  # how long a fault waits for the sink to get where it strikes (a batch planned and started)
HEALTHY_S = 180.0  # how long a fault waits for every partition to be fully replicated before it starts


class ClusterFaults:
    """Injects :data:`~oncekit.verify.faults.CLUSTER_FAULTS` into the brokers of ``kafka`` (the
    sink writes ``topic``) and the executors of ``spark`` (None: no standalone cluster, and an
    executor fault is refused). Called by the campaign: :meth:`before_input` before it produces
    a fault's chunk, :meth:`inject` after, :meth:`note` for the table."""

    def __init__(self, kafka: KafkaService, topic: str, crash_dir: str, spark_log: SparkLog,
                 spark: StandaloneCluster | None = None) -> None:
        self.kafka, self.topic, self.crash_dir, self.spark_log, self.spark = kafka, topic, crash_dir, spark_log, spark
        self.config = kafka.config  # with the service's client settings (SASL, TLS) if it has any
        self._notes: dict[str, str] = {}  # per kind, what its last injection hit
        self._planned_before: int | None = None  # the last batch planned before the fault's chunk

    def note(self, kind: str) -> str:
        return f"; {self._notes[kind]}" if kind in self._notes else ""

    def before_input(self, fault: Fault) -> None:
        """Before the chunk: a healthy cluster for a broker fault, for a coordinator kill the
        hold armed, so that the first commit of the chunk's batch stops there, and for an
        executor kill the last batch planned so far (the batch to hit reads the chunk)."""
        self._planned_before = self.spark_log.latest_planned()
        if fault.kind.startswith("kafka-"):
            self._wait_healthy()
        if fault.kind == "kafka-coordinator-kill":
            arm(self.crash_dir, HOLD_POINT, hold=True)

    def inject(self, fault: Fault) -> bool:
        """Inject ``fault`` (after its ``delay_s``, or where the sink gets to); True if it hit."""
        if fault.kind not in CLUSTER_FAULTS:
            raise VerifyError(f"not a cluster fault: {fault.kind}")
        if fault.kind == "kafka-coordinator-kill":
            return self._kill_coordinator(fault.outage_s)
        if fault.kind == "spark-executor-kill":
            return self._kill_executor()
        time.sleep(fault.delay_s)
        if fault.kind == "kafka-rolling-restart":
            for broker in self.kafka.brokers:
                self._wait_healthy()
                broker.restart()
            self._notes[fault.kind] = f"brokers {', '.join(str(b.node_id) for b in self.kafka.brokers)} in turn"
            return True
        leader = self._broker(partition_leader(self.config, self.topic, 0))
        if leader is None:
            self._notes[fault.kind] = f"{self.topic}[0] had no leader"
            return False
        self._notes[fault.kind] = f"broker {leader.node_id} (leader of {self.topic}[0])"
        leader.outage("kill" if fault.kind == "kafka-leader-kill" else "cut", fault.outage_s)
        return True

    def _broker(self, node_id: int) -> KafkaService | None:
        return next((b for b in self.kafka.brokers if b.node_id == node_id), None)

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + HEALTHY_S
        while lagging := under_replicated(self.config):
            if time.monotonic() > deadline:
                raise VerifyError(f"kafka at {self.kafka.bootstrap_servers}: partitions still under-replicated "
                                  f"after {HEALTHY_S:.0f} s: {', '.join(lagging[:5])}")
            time.sleep(0.5)

    def _kill_coordinator(self, outage_s: float) -> bool:
        """Wait for the held commit, kill the coordinator of its transaction, let the sink go on."""
        kind = "kafka-coordinator-kill"
        deadline = time.monotonic() + REACH_S
        while (held := fired_at(self.crash_dir, HOLD_POINT)) is None:
            if time.monotonic() > deadline:
                if not disarm(self.crash_dir, HOLD_POINT):  # it fired just now: let it go on
                    release(self.crash_dir, HOLD_POINT)
                self._notes[kind] = "no Kafka commit reached"
                return False
            time.sleep(0.1)
        try:
            broker = self._held_coordinator(held)
            if broker is None:
                return False
            broker.kill()
        finally:
            release(self.crash_dir, HOLD_POINT)
        time.sleep(outage_s)
        broker.start()
        return True

    def _held_coordinator(self, held: dict[str, int | None]) -> KafkaService | None:
        """The broker that coordinates the held transaction: it is open (Ongoing) and holds
        records of the sink's topic. The records go out in the background (linger 5 ms), so it
        looks again until they show."""
        kind = "kafka-coordinator-kill"
        found = []
        for _ in range(10):
            found = [t for t in open_transactions(self.kafka.bootstrap_servers, self.kafka.client, timeout_s=60)
                     if self.topic in t.topics() and t.coordinator is not None]
            if found:
                break
            time.sleep(0.5)
        if not found:
            self._notes[kind] = f"no open transaction on {self.topic} found (held at batch {held.get('batch')})"
            return None
        transaction = found[0]
        broker = self._broker(transaction.coordinator or -1)
        if broker is None:
            self._notes[kind] = f"coordinator {transaction.coordinator} is not one of the brokers"
            return None
        self._notes[kind] = (f"broker {broker.node_id} (coordinator of {transaction.transactional_id}, "
                             f"batch {held.get('batch')})")
        return broker

    def _kill_executor(self) -> bool:
        """SIGKILL an executor JVM once a batch that reads the chunk is planned and not yet
        committed."""
        kind = "spark-executor-kill"
        if self.spark is None:
            raise VerifyError("spark-executor-kill needs a Spark standalone cluster (run_campaign's spark_cluster)")
        first = -1 if self._planned_before is None else self._planned_before + 1
        deadline = time.monotonic() + REACH_S
        while True:
            planned, committed = self.spark_log.latest_planned(), self.spark_log.latest_completed()
            running = planned is not None and planned >= first and planned != committed
            executors = self.spark.executor_pids() if running else []
            if executors:
                break
            if time.monotonic() > deadline:
                self._notes[kind] = "no batch ran on an executor"
                return False
            time.sleep(0.05)
        os.kill(executors[0], signal.SIGKILL)
        self._notes[kind] = f"executor pid {executors[0]} in batch {planned}"
        logger.info("verify: killed executor pid %s during batch %s", executors[0], planned)
        return True

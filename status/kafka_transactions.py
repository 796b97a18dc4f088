"""Open Kafka transactions, from the broker's own tool.

confluent-kafka's AdminClient (librdkafka) has no ListTransactions or DescribeTransactions (checked
with 2.16: neither call exists), and no maintained Python client offers them together with the
rest of what the kit needs. So this module runs Kafka's ``TransactionsCommand`` (the class behind
``kafka-transactions.sh``) with the machine's Java, from the jars ``docker/kafka-tools/fetch.sh``
fetches from Maven Central (same Kafka release as the broker). :func:`open_transactions` is the
one function the rest of the kit calls; a Python client with these calls would replace its body.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from oncekit.connectors.redact import redact_config
from oncekit.core.errors import ServiceError

logger = logging.getLogger(__name__)

_REPO_DOCKER = Path(__file__).resolve().parents[1] / "docker"
_TOOL = "org.apache.kafka.tools.TransactionsCommand"
OPEN_STATES = frozenset({"Ongoing", "PrepareCommit", "PrepareAbort"})
"""Transaction states in which the partitions a transaction wrote hold back read_committed readers."""


@dataclass(frozen=True)
class KafkaTransaction:
    """An open transaction as the broker's coordinator describes it."""

    transactional_id: str
    producer_id: int | None
    state: str
    timeout_ms: int
    age_s: float
    partitions: tuple[str, ...]  # "topic-partition", as Kafka prints a TopicPartition
    coordinator: int | None = None  # node id of the broker that coordinates the transaction

    def topics(self) -> set[str]:
        return {p.rsplit("-", 1)[0] for p in self.partitions}


def tools_libs() -> Path:
    """The folder of Kafka's tool jars: ``ONCEKIT_KAFKA_TOOLS_LIBS``, or the repository's Maven
    output, fetched on first use with docker/kafka-tools/fetch.sh."""
    configured = os.environ.get("ONCEKIT_KAFKA_TOOLS_LIBS")
    libs = Path(configured) if configured else _REPO_DOCKER / "kafka-tools" / "target" / "libs"
    if not list(libs.glob("kafka-tools-[0-9]*.jar")):
        fetch = _REPO_DOCKER / "kafka-tools" / "fetch.sh"
        if configured or not fetch.exists():
            raise ServiceError(f"kafka: no Kafka tool jars in {libs}: set ONCEKIT_KAFKA_TOOLS_LIBS to a folder holding "
                               "kafka-tools and its dependencies (mvn -f docker/kafka-tools/pom.xml package)")
        result = subprocess.run([str(fetch)], capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise ServiceError(f"kafka: fetching Kafka's tools failed: {result.stderr.strip()[-300:]}")
    return libs


def _table(text: str) -> list[dict[str, str]]:
    """Rows of the tool's whitespace-aligned table; a last column with no value is empty."""
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        return []
    header = lines[0].split()
    rows = []
    for line in lines[1:]:
        values = line.split()
        rows.append(dict(zip(header, values + [""] * (len(header) - len(values)))))
    return rows


class _Tool:
    """One TransactionsCommand invocation per call, against one cluster."""

    def __init__(self, bootstrap_servers: str, client: Mapping[str, Any], timeout_s: float) -> None:
        java = shutil.which("java")
        if java is None:
            raise ServiceError("kafka: no Java on the PATH to run Kafka's TransactionsCommand; install a JRE 17")
        self.command = [java, "-Xmx128m", "-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC", "-cp", f"{tools_libs()}/*", _TOOL,
                        "--bootstrap-server", bootstrap_servers]
        self.client, self.timeout_s = client, timeout_s
        self.bootstrap_servers = bootstrap_servers

    def __call__(self, *args: str) -> str:
        with tempfile.TemporaryDirectory(prefix="oncekit-kafka-tools-") as folder:
            command = list(self.command)
            if self.client:
                properties = Path(folder) / "client.properties"
                properties.write_text("".join(f"{k}={v}\n" for k, v in self.client.items()))
                properties.chmod(0o600)
                command[-2:-2] = ["--command-config", str(properties)]
            try:
                result = subprocess.run([*command, *args], capture_output=True, text=True, timeout=self.timeout_s,
                                        check=False)
            except subprocess.TimeoutExpired as exc:
                raise ServiceError(f"kafka at {self.bootstrap_servers}: TransactionsCommand {args[0]} took over "
                                   f"{self.timeout_s:.0f} s") from exc
        if result.returncode != 0:
            detail = (result.stderr.strip().splitlines() or ["no output"])[-1][:300]
            raise ServiceError(f"kafka at {self.bootstrap_servers}: TransactionsCommand {args[0]} failed "
                               f"(client {redact_config(self.client)}): {detail}")
        return result.stdout


def open_transactions(bootstrap_servers: str, client: Mapping[str, Any] | None = None,
                      transactional_ids: Sequence[str] | None = None, timeout_s: float = 30.0) -> list[KafkaTransaction]:
    """Every transaction the cluster's coordinators hold open (Ongoing, PrepareCommit or
    PrepareAbort), oldest first, each with its coordinator (Kafka's DescribeTransactions);
    ``transactional_ids`` limits it to those ids. Called by the status page's collector on a
    thread of its own, and by the campaign to find the coordinator of a transaction it holds open (each call starts a JVM per open transaction, about
    half a second each). Raises :class:`ServiceError` when the broker or the tool fails."""
    tool = _Tool(bootstrap_servers, dict(client or {}), timeout_s)
    listed = [row for row in _table(tool("list")) if row.get("TransactionState") in OPEN_STATES]
    if transactional_ids is not None:
        wanted = set(transactional_ids)
        listed = [row for row in listed if row.get("TransactionalId") in wanted]
    now_ms = time.time() * 1000
    found = []
    for row in listed:
        for described in _table(tool("describe", "--transactional-id", row["TransactionalId"])):
            if described.get("TransactionState") not in OPEN_STATES:
                continue  # finished between the two calls
            duration, started = described.get("TransactionDurationMs", ""), described.get("CurrentTransactionStartTimeMs", "")
            age_ms = float(duration) if duration.isdigit() else (now_ms - int(started) if started.isdigit() else 0.0)
            found.append(KafkaTransaction(
                transactional_id=described["TransactionalId"], producer_id=int(described["ProducerId"]) if described.get("ProducerId", "").isdigit() else None,
                state=described["TransactionState"], timeout_ms=int(described.get("TransactionTimeoutMs") or 0),
                age_s=age_ms / 1000, partitions=tuple(p for p in described.get("TopicPartitions", "").split(",") if p),
                coordinator=int(described["CoordinatorId"]) if described.get("CoordinatorId", "").isdigit() else None))
    return sorted(found, key=lambda t: -t.age_s)

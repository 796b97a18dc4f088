"""``oncekit doctor``: preflight checks of the machine and of a job's Kafka and PostgreSQL.

What it checks is a :class:`DoctorTarget`: made from flags for any job (:func:`target_from_flags`:
the addresses, the topics, the queries' checkpoints) or from the reference pipeline's config
(:func:`target_from_config`).

Each check answers with a status (ok, warn, fail), one line of detail and one line of fix. The
checks catch what users of exactly-once pipelines trip over: a Java or Spark too old for the
kit, a broker whose transaction settings make transactions time out or refuse the sinks'
timeout, a server that forbids prepared transactions or runs SERIALIZABLE by default. Reuses
:func:`oncekit.connectors.kafka_admin.check_broker` and :func:`oncekit.connectors.postgres.check_server`.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from oncekit.connectors.redact import redact_dsn
from oncekit.core.compat import SUPPORTED_SPARK, spark_supported
from oncekit.core.errors import OncekitError

if TYPE_CHECKING:
    from oncekit.reference.config import PipelineConfig

OK, WARN, FAIL = "ok", "warn", "fail"


@dataclass(frozen=True)
class DoctorTarget:
    """What the checks look at: the Kafka cluster (``bootstrap``, ``kafka_client``: librdkafka
    settings such as SASL), the ``topics`` the job reads or writes, the PostgreSQL server
    (``dsn``), and how many prepared transactions its two-phase-commit sinks hold at once: one per
    writer partition (``writer_partitions``; None: a new query's shuffle partitions) and target
    (``two_phase_targets``), for each batch in flight."""

    bootstrap: str
    dsn: str = field(default="", repr=False)
    kafka_client: Mapping[str, str] = field(default_factory=dict, repr=False)
    topics: tuple[str, ...] = ()
    writer_partitions: int | None = None
    two_phase_targets: int = 1


@dataclass(frozen=True)
class Check:
    """One check's answer."""

    name: str
    status: str
    detail: str
    fix: str = ""


def _java() -> Check:
    import os

    java = shutil.which("java", path=f"{os.environ['JAVA_HOME']}/bin") if os.environ.get("JAVA_HOME") else None
    java = java or shutil.which("java")
    fix = "install Java 17 or 21 (apt-get install openjdk-17-jre-headless) or set JAVA_HOME"
    if java is None:
        return Check("java", FAIL, "no java on PATH or in JAVA_HOME", fix)
    try:
        text = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=30).stderr
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Check("java", FAIL, f"{java} -version failed: {exc}", fix)
    found = re.search(r'version "(\d+)(?:\.(\d+))?', text)
    major = int(found.group(1)) if found else 0
    if major == 1 and found and found.group(2):
        major = int(found.group(2))
    if major < 17:
        return Check("java", FAIL, f"Java {major or '?'} at {java}; Spark 4 needs 17 or newer", fix)
    return Check("java", OK, f"Java {major} at {java}")


def _spark() -> Check:
    try:
        import pyspark
    except ImportError:
        return Check("spark", FAIL, "pyspark is not installed", "pip install 'oncekit[spark]'")
    version = pyspark.__version__
    if not spark_supported(version):
        return Check("spark", FAIL, f"PySpark {version}; oncekit supports {SUPPORTED_SPARK[0][0]}.{SUPPORTED_SPARK[0][1]} "
                     f"up to {SUPPORTED_SPARK[1][0]}.0, as its [spark] extra says", "pip install 'oncekit[spark]'")
    missing = [m for m in ("google.protobuf", "grpc") if importlib.util.find_spec(m) is None]
    if missing:
        return Check("spark", FAIL, f"PySpark {version}, but {', '.join(missing)} missing (transformWithState needs them)",
                     "pip install protobuf grpcio")
    return Check("spark", OK, f"PySpark {version} with protobuf and grpcio (transformWithState, RocksDB state store)")


def _reachable(service: str, address: str, check: Callable[[str], None], missing_fix: str, failed_fix: str,
               shown: str) -> Check:
    """The first check of a service: configured, and answering."""
    if not address:
        return Check(service, FAIL, "not configured", missing_fix)
    try:
        check(address)
    except OncekitError as exc:
        return Check(service, FAIL, str(exc), failed_fix)
    return Check(service, OK, shown)


def _kafka(target: DoctorTarget) -> list[Check]:
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    from oncekit.connectors.kafka import KafkaConfig

    from oncekit.connectors.kafka_admin import broker_settings, check_broker
    from oncekit.sinks.kafka import DEFAULT_TRANSACTION_TIMEOUT_MS as sink_timeout_ms

    bootstrap, client = target.bootstrap, dict(target.kafka_client)
    reached = _reachable("kafka", bootstrap, lambda address: check_broker(address, client),
                         "give --bootstrap, set ONCEKIT_KAFKA_BOOTSTRAP, or run 'oncekit services up'",
                         "start the broker, or fix the bootstrap address; a single broker needs "
                         "transaction.state.log.replication.factor=1 and transaction.state.log.min.isr=1",
                         f"{bootstrap} answers and a transactional producer initialises")
    if reached.status == FAIL:
        return [reached]
    checks = [reached]
    kafka = KafkaConfig(bootstrap, dict(client))
    try:
        metadata = AdminClient(kafka.settings()).list_topics(timeout=10)
        brokers = len(metadata.brokers)
        settings: dict[str, Any] = broker_settings(kafka)
    except KafkaException as exc:
        return [*checks, Check("kafka settings", WARN, f"cannot read the broker's settings: {exc.args[0]}",
                               "grant DescribeConfigs on the cluster to check them")]
    max_timeout = int(settings.get("transaction.max.timeout.ms") or 900_000)
    checks.append(Check("kafka transaction.max.timeout.ms", OK if max_timeout >= sink_timeout_ms else FAIL,
                        f"{max_timeout} ms; the Kafka sinks ask for {sink_timeout_ms} ms",
                        "" if max_timeout >= sink_timeout_ms else
                        f"raise transaction.max.timeout.ms to at least {sink_timeout_ms} on the brokers"))
    for name in ("transaction.state.log.replication.factor", "transaction.state.log.min.isr",
                 "offsets.topic.replication.factor"):
        value = int(settings.get(name) or 1)
        checks.append(Check(f"kafka {name}", OK if value <= brokers else FAIL, f"{value} with {brokers} broker(s)",
                            "" if value <= brokers else f"set {name}={brokers} (or fewer) or add brokers; "
                            "otherwise every transaction times out"))
    expiration = int(settings.get("transactional.id.expiration.ms") or 604_800_000)
    checks.append(Check("kafka transactional.id.expiration.ms", OK if expiration >= 3_600_000 else WARN,
                        f"{expiration // 60_000} min", "" if expiration >= 3_600_000 else
                        "raise it above the longest pipeline downtime, or batch markers of idle sinks expire"))
    for topic in target.topics:
        exists = topic in metadata.topics
        checks.append(Check(f"kafka topic {topic}", OK if exists else WARN,
                            f"{len(metadata.topics[topic].partitions)} partitions" if exists else "missing",
                            "" if exists else "create it before the job reads it (a sink creates the topics it writes)"))
    checks.append(Check("kafka isolation level", OK, "the source reads read_committed (kafka.isolation.level)"))
    return checks


def _postgres(target: DoctorTarget) -> list[Check]:
    from oncekit.connectors.postgres import check_server, connect

    dsn = target.dsn
    reached = _reachable("postgres", dsn, check_server,
                         "give --dsn (or set ONCEKIT_POSTGRES_DSN), or run 'oncekit services up'",
                         "start the server, or fix the connection string", f"{redact_dsn(dsn)} accepts connections")
    if reached.status == FAIL:
        return [reached]
    checks = [reached]
    with connect(dsn, autocommit=True, connect_timeout=10) as conn:
        def show(name: str) -> str:
            row = conn.execute(f"SHOW {name}").fetchone()
            return str(row[0]) if row else ""

        version = int(show("server_version_num") or 0)
        prepared = int(show("max_prepared_transactions") or 0)
        isolation = show("default_transaction_isolation")
    checks.append(Check("postgres version", OK if version >= 110000 else FAIL, f"{version // 10000}",
                        "" if version >= 110000 else "use PostgreSQL 11 or newer"))
    wanted, why = prepared_wanted(target)
    status = FAIL if prepared == 0 else WARN if prepared < wanted else OK
    checks.append(Check("postgres max_prepared_transactions", status,
                        f"{prepared}; two-phase commit holds up to {wanted} at once here ({why})",
                        "" if status == OK else f"start postgres with -c max_prepared_transactions={max(64, wanted)} "
                        "(needs a restart)"))
    checks.append(Check("postgres default_transaction_isolation", WARN if isolation == "serializable" else OK, isolation,
                        "set it to 'read committed': the sinks' upserts fail with serialization errors otherwise"
                        if isolation == "serializable" else ""))
    return checks


IN_FLIGHT_BATCHES = 3
"""Batches whose prepared transactions can be open at once: the running one, the one the
listener commits, and one a restart runs again while recovery settles the last."""


def prepared_wanted(target: DoctorTarget) -> tuple[int, str]:
    """How many prepared transactions the job can hold at once, and why: one per writer partition
    (the queries' state partitions, as their checkpoints fixed them, else the shuffle partitions
    a new query gets) and two-phase-commit target, for each batch in flight."""
    from oncekit.core.spark.session import default_conf

    partitions = target.writer_partitions or int(default_conf()["spark.sql.shuffle.partitions"])
    targets = target.two_phase_targets
    return (partitions * targets * IN_FLIGHT_BATCHES,
            f"{partitions} writer partitions x {targets} two-phase-commit targets x {IN_FLIGHT_BATCHES} batches in flight")


def _state_partitions(checkpoints: Sequence[str]) -> int | None:
    """The most state partitions any of the queries checkpointed at ``checkpoints`` has."""
    from oncekit.core.spark_log import SparkLog

    found = []
    for checkpoint in checkpoints:
        try:
            found.append(SparkLog(checkpoint).state_partitions())
        except OSError:
            continue
    return max((n for n in found if n), default=None)


def target_from_config(config: PipelineConfig) -> DoctorTarget:
    """The reference pipeline's services, input topic, checkpoint and two-phase-commit targets."""
    return DoctorTarget(config.kafka_bootstrap(), config.postgres_dsn(),
                        config.kafka_config().client if config.kafka_bootstrap() else {}, (config.topics.payments,),
                        _state_partitions([f"{config.pipeline.checkpoint}/pipeline"]),
                        sum(protocol == "two-phase-commit"
                            for protocol in (config.guarantees.balances, config.guarantees.minute_totals)))


def target_from_flags(bootstrap: str | None, dsn: str | None, topics: Sequence[str] = (),
                      checkpoints: Sequence[str] = (), two_phase_targets: int = 1) -> DoctorTarget:
    """Any job's: its addresses (:func:`~oncekit.connectors.services.service_addresses`), the
    librdkafka settings of the file ONCEKIT_KAFKA_CLIENT_CONFIG names, and the state partitions of
    its queries' ``checkpoints``."""
    import os

    from oncekit.connectors.kafka_broker import client_properties
    from oncekit.connectors.services import service_addresses

    bootstrap, dsn = service_addresses(bootstrap, dsn)
    client_file = os.environ.get("ONCEKIT_KAFKA_CLIENT_CONFIG", "")
    return DoctorTarget(bootstrap, dsn, client_properties(client_file) if client_file else {}, tuple(topics),
                        _state_partitions(checkpoints), two_phase_targets)


def run(target: DoctorTarget) -> list[Check]:
    """Every check, in order: the machine, Kafka, PostgreSQL. Never raises for a failed check."""
    checks: list[Check] = []
    steps: list[Callable[[], Check | list[Check]]] = [_java, _spark, lambda: _kafka(target), lambda: _postgres(target)]
    for step in steps:
        found = step()
        checks.extend(found if isinstance(found, list) else [found])
    return checks


def table(checks: list[Check]) -> str:
    """The checks as lines: status, name, detail, and the fix where there is one."""
    width = max(len(c.name) for c in checks)
    lines = []
    for check in checks:
        lines.append(f"{check.status.upper():<4}  {check.name:<{width}}  {check.detail}")
        if check.fix:
            lines.append(f"{'':<4}  {'':<{width}}  fix: {check.fix}")
    return "\n".join(lines)


def main(target: DoctorTarget) -> int:
    """``oncekit doctor``: run the checks against ``target``, print them and return 1 if any
    failed."""
    checks = run(target)
    print(table(checks))
    failed = [c for c in checks if c.status == FAIL]
    print(f"{len(checks)} checks: {len(failed)} failed" if failed else f"{len(checks)} checks passed")
    return 1 if failed else 0

"""``oncekit doctor``: preflight checks of the machine and the configured Kafka and PostgreSQL.

Each check answers with a status (ok, warn, fail), one line of detail and one line of fix. The
checks catch what users of exactly-once pipelines trip over: a Java or Spark too old for the
kit, a broker whose transaction settings make transactions time out or refuse the sinks'
timeout, a server that forbids prepared transactions or runs SERIALIZABLE by default. Reuses
:func:`oncekit.connectors.kafka.check_broker` and :func:`oncekit.connectors.postgres.check_server`.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from oncekit.connectors.redact import redact_dsn
from oncekit.core.errors import OncekitError
from oncekit.reference.config import PipelineConfig, load_with_services

OK, WARN, FAIL = "ok", "warn", "fail"


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
    major, minor = (int(p) for p in version.split(".")[:2])
    if (major, minor) < (4, 1):
        return Check("spark", FAIL, f"PySpark {version}; transformWithState needs 4.1 or newer", "pip install 'oncekit[spark]'")
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


def _kafka(config: PipelineConfig) -> list[Check]:
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    from oncekit.connectors.kafka import KafkaConfig, broker_settings, check_broker
    from oncekit.sinks.kafka import DEFAULT_TRANSACTION_TIMEOUT_MS as sink_timeout_ms

    bootstrap = config.kafka_bootstrap()
    client = config.kafka_config().client if bootstrap else {}
    reached = _reachable("kafka", bootstrap, lambda address: check_broker(address, client),
                         "set [services] kafka_bootstrap, ONCEKIT_KAFKA_BOOTSTRAP, or run 'oncekit services up'",
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
    topic = config.topics.payments
    exists = topic in metadata.topics
    checks.append(Check(f"kafka topic {topic}", OK if exists else WARN,
                        f"{len(metadata.topics[topic].partitions)} partitions" if exists else "missing",
                        "" if exists else "the pipeline creates it; or: oncekit produce"))
    checks.append(Check("kafka isolation level", OK, "the source reads read_committed (kafka.isolation.level)"))
    return checks


def _postgres(config: PipelineConfig) -> list[Check]:
    from oncekit.connectors.postgres import check_server, connect

    dsn = config.postgres_dsn()
    reached = _reachable("postgres", dsn, check_server,
                         "set [services] postgres_dsn, ONCEKIT_POSTGRES_DSN, or run 'oncekit services up'",
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
    wanted, why = prepared_wanted(config)
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


def prepared_wanted(config: PipelineConfig) -> tuple[int, str]:
    """How many prepared transactions the reference pipeline can hold at once, and why: one per
    writer partition (the query's state partitions, as its checkpoint fixed them, else the
    shuffle partitions a new one gets) and two-phase-commit target, for each batch in flight."""
    from oncekit.core.spark.session import default_conf
    from oncekit.core.spark_log import SparkLog

    try:
        partitions = SparkLog(f"{config.pipeline.checkpoint}/pipeline").state_partitions()
    except OSError:
        partitions = None
    partitions = partitions or int(default_conf()["spark.sql.shuffle.partitions"])
    targets = sum(protocol == "two-phase-commit" for protocol in (config.guarantees.balances, config.guarantees.minute_totals))
    return (partitions * targets * IN_FLIGHT_BATCHES,
            f"{partitions} writer partitions x {targets} two-phase-commit targets x {IN_FLIGHT_BATCHES} batches in flight")


def run(config: PipelineConfig) -> list[Check]:
    """Every check, in order: the machine, Kafka, PostgreSQL. Never raises for a failed check."""
    checks: list[Check] = []
    steps: list[Callable[[], Check | list[Check]]] = [_java, _spark, lambda: _kafka(config), lambda: _postgres(config)]
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


def main(config_path: str | None = None, overrides: Mapping[str, Any] | None = None) -> int:
    """``oncekit doctor``: run the checks against the pipeline config (``config_path`` and
    ``overrides``, see :func:`oncekit.reference.config.load_with_services`), print them and
    return 1 if any failed."""
    checks = run(load_with_services(config_path, overrides))
    print(table(checks))
    failed = [c for c in checks if c.status == FAIL]
    print(f"{len(checks)} checks: {len(failed)} failed" if failed else f"{len(checks)} checks passed")
    return 1 if failed else 0

"""The local-process backend, for machines with no container engine.

Kafka runs as a KRaft JVM from the official broker jars (fetched from Maven Central by
docker/kafka/pom.xml); PostgreSQL is a throwaway cluster made with the machine's own server
binaries. Both listen on free loopback ports and keep their data in a temporary folder.
"""

from __future__ import annotations

import glob
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import MappingProxyType
from typing import Any
from urllib.parse import quote

from psycopg.conninfo import make_conninfo

from oncekit.connectors.redact import redact_dsn
from oncekit.connectors.services.tls import CertificateAuthority
from oncekit.connectors.services.base import (
    KafkaCluster,
    KafkaService,
    PostgresService,
    free_port,
    free_ports,
    port_in_use,
)
from oncekit.connectors.wait import wait_until
from oncekit.connectors.kafka_broker import CLUSTER_ID, BrokerAddress, broker_properties
from oncekit.connectors.postgres import MAX_PREPARED_TRANSACTIONS, check_server, connect
from oncekit.core.errors import ServiceError
from oncekit.core.stacks import log_tail

logger = logging.getLogger(__name__)

_REPO_DOCKER = Path(__file__).resolve().parents[2] / "docker"


def broker_libs() -> Path:
    """The folder of Kafka broker jars: ``ONCEKIT_KAFKA_LIBS``, or the repository's Maven
    output, fetched on first use with docker/fetch-kafka.sh."""
    configured = os.environ.get("ONCEKIT_KAFKA_LIBS")
    libs = Path(configured) if configured else _REPO_DOCKER / "kafka" / "target" / "libs"
    if not glob.glob(str(libs / "kafka_2.13-*.jar")):
        fetch = _REPO_DOCKER / "fetch-kafka.sh"
        if configured or not fetch.exists():
            raise ServiceError(
                f"kafka: no broker jars in {libs}: set ONCEKIT_KAFKA_LIBS to a folder holding them "
                "(mvn -f docker/kafka/pom.xml package fetches them)"
            )
        result = subprocess.run([str(fetch)], capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise ServiceError(result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "kafka: fetch failed")
    return libs


def _require(program: str, what: str) -> str:
    path = shutil.which(program)
    if path is None:
        raise ServiceError(what)
    return path


def _postgres_bin(program: str) -> str:
    found = shutil.which(program) or next(iter(sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{program}"), reverse=True)), None)
    if found is None:
        raise ServiceError(f"postgres: no PostgreSQL server binaries ({program} not found); install postgresql")
    return found


def _as_postgres_user(argv: list[str]) -> list[str]:
    """PostgreSQL refuses to run as root; as root, run it as the machine's postgres user."""
    if os.geteuid() != 0:
        return argv
    try:
        import pwd

        pwd.getpwnam("postgres")
    except KeyError as exc:
        raise ServiceError("postgres: running as root and there is no 'postgres' user to run the server as") from exc
    return ["setpriv", "--reuid=postgres", "--regid=postgres", "--init-groups", *argv]


def _chown_postgres(path: Path) -> None:
    if os.geteuid() == 0:
        shutil.chown(path, "postgres", "postgres")


class _Process:
    """A server process in its own session, so that stopping it stops its children too."""

    def __init__(self, argv: list[str], log: Path, pid: int | None = None,
                 stop_signal: signal.Signals = signal.SIGTERM) -> None:
        self.argv, self.log, self.pid, self.stop_signal = argv, log, pid, stop_signal

    def launch(self) -> None:
        with open(self.log, "ab") as out:
            self.pid = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True).pid

    def alive(self) -> bool:
        if self.pid is None:
            return False
        try:
            finished, _ = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:  # not our child (another CLI call started it)
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                return False
            return True
        return finished == 0

    def terminate(self, timeout_s: float = 30.0) -> None:
        if self.pid is None or not self.alive():
            return
        os.killpg(self.pid, self.stop_signal)
        deadline = time.monotonic() + timeout_s
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        if self.alive():
            os.killpg(self.pid, signal.SIGKILL)
            while self.alive():
                time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL the server process first (a PostgreSQL postmaster, a broker JVM), then what it
        leaves in its session: a postmaster's backends would exit on their own once they notice,
        but a new server refuses to start while they still hold the old shared memory."""
        if self.pid is None or not self.alive():
            return
        os.kill(self.pid, signal.SIGKILL)
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        while self.alive():
            time.sleep(0.05)

    def log_tail(self, lines: int = 5) -> str:
        return log_tail(self.log, lines)


class _LocalService:
    """Stop and remove for both local services: a process of ours and a data folder of ours."""

    backend = "local"
    data_dir: Path
    _process: _Process

    def stop(self) -> None:
        self._process.terminate()

    def kill(self) -> None:
        self._process.kill()

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.data_dir, ignore_errors=True)


class LocalKafka(_LocalService, KafkaService):

    def __init__(self, data_dir: Path, port: int, controller_port: int, pid: int | None = None, node_id: int = 1) -> None:
        self.data_dir, self.port, self.controller_port, self.node_id = data_dir, port, controller_port, node_id
        self.bootstrap_servers = f"127.0.0.1:{port}"
        java = _require("java", "kafka: no Java on the PATH; install a JRE 17 (apt-get install openjdk-17-jre-headless)")
        classpath = f"{broker_libs()}/*"
        self._config = data_dir / "server.properties"
        log4j = _REPO_DOCKER / "kafka" / "log4j2.properties"
        self._java = [java, *os.environ.get("KAFKA_HEAP_OPTS", "-Xmx512m").split(),
                      *os.environ.get("KAFKA_JVM_PERFORMANCE_OPTS", "").split(), "-cp", classpath]
        if log4j.exists():
            self._java.insert(1, f"-Dlog4j2.configurationFile={log4j}")
        self._process = _Process([*self._java, "kafka.Kafka", str(self._config)], data_dir / "broker.log", pid)

    @classmethod
    def create(cls, brokers: int = 1, settings: Mapping[str, str] | None = None) -> KafkaService:
        """One broker, or a :class:`KafkaCluster` of ``brokers`` brokers on loopback (they share
        the host's, so one listener serves clients and the other brokers alike), with ``settings``
        over the kit's server properties; returns once every broker is ready."""
        ports = free_ports(2 * brokers)
        nodes = [BrokerAddress(i + 1, ports[2 * i], ports[2 * i + 1]) for i in range(brokers)]
        cluster = KafkaCluster(backend="local")
        try:
            made = []
            for node in nodes:
                made.append(cls(Path(tempfile.mkdtemp(prefix=f"oncekit-kafka-{node.node_id}-")), node.port,
                                node.controller_port, node_id=node.node_id))
                cluster.add(made[-1])
            with ThreadPoolExecutor(brokers) as pool:  # a JVM each, some seconds: at once
                list(pool.map(lambda kafka, node: kafka._format({**broker_properties(node, nodes), **(settings or {})}),
                              made, nodes))
            cluster.start()  # together: no broker is ready before a majority of the quorum runs
        except BaseException:
            cluster.remove()
            raise
        return cluster.brokers[0] if brokers == 1 else cluster

    def _format(self, properties: dict[str, str], *format_args: str) -> None:
        properties = {**properties, "log.dirs": str(self.data_dir / "data")}
        self._config.write_text("".join(f"{key}={value}\n" for key, value in properties.items()))
        self._config.chmod(0o600)  # a secured broker's file holds its keystore password
        formatted = subprocess.run(
            [*self._java, "kafka.tools.StorageTool", "format", "-t", CLUSTER_ID, "-c", str(self._config), *format_args],
            capture_output=True, text=True, check=False,
        )
        if formatted.returncode != 0:
            raise ServiceError(f"kafka: formatting the KRaft log of node {self.node_id} failed: "
                               f"{formatted.stderr.strip()[-300:]}")

    def start(self) -> None:
        for port in (self.port, self.controller_port):
            if port_in_use(port):
                raise ServiceError(f"kafka: port {port} on 127.0.0.1 is in use")
        self._process.launch()
        logger.info("kafka: local broker %s pid %s at %s", self.node_id, self._process.pid, self.bootstrap_servers)
        self.wait_ready()

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        time.sleep(0.5)
        if not self._process.alive():
            raise ServiceError(f"kafka: local broker {self.node_id} exited at start: {self._process.log_tail()}")
        super().wait_ready(timeout_s)

    def state(self) -> dict[str, Any]:
        return {"data_dir": str(self.data_dir), "port": self.port, "controller_port": self.controller_port,
                "pid": self._process.pid, "node_id": self.node_id}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> KafkaService:
        if "brokers" in state:
            return KafkaCluster([cls.from_state(b) for b in state["brokers"]], "local")
        return cls(Path(state["data_dir"]), state["port"], state["controller_port"], state["pid"],
                   state.get("node_id", 1))


class SecuredLocalKafka(LocalKafka):
    """One local broker whose only client listener is SASL_SSL: TLS with a certificate that a
    given CA signed, and SCRAM-SHA-256 with one user, :data:`USER`, whose password is made here.
    Its :attr:`client` settings carry what clients need (the password and the CA's certificate);
    the broker's own connections to itself use the same listener."""

    USER = "oncekit"

    def __init__(self, data_dir: Path, port: int, controller_port: int, password: str, pid: int | None = None) -> None:
        super().__init__(data_dir, port, controller_port, pid)
        self._password = password
        self.client = MappingProxyType({
            "security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-256", "sasl.username": self.USER,
            "sasl.password": password, "ssl.ca.location": str(data_dir / "ca.pem"),
        })

    @classmethod
    def secured(cls, ca: CertificateAuthority) -> SecuredLocalKafka:
        import secrets

        port, controller_port = free_ports(2)
        kafka = cls(Path(tempfile.mkdtemp(prefix="oncekit-kafka-secured-")), port, controller_port,
                    secrets.token_urlsafe(16))
        try:
            store_password = secrets.token_urlsafe(16)
            shutil.copy(ca.certificate, kafka.data_dir / "ca.pem")
            keystore = kafka.data_dir / "server.p12"
            shutil.copy(ca.issue("kafka").pkcs12(store_password), keystore)
            plain = broker_properties(BrokerAddress(1, port, controller_port))
            kafka._format({**{key: _sasl_ssl(value) if key in _CLIENT_LISTENER_KEYS else value
                              for key, value in plain.items()},
                           "sasl.enabled.mechanisms": "SCRAM-SHA-256",
                           "sasl.mechanism.inter.broker.protocol": "SCRAM-SHA-256",
                           "listener.name.sasl_ssl.scram-sha-256.sasl.jaas.config":
                               "org.apache.kafka.common.security.scram.ScramLoginModule required "
                               f'username="{cls.USER}" password="{kafka._password}";',
                           "ssl.keystore.type": "PKCS12", "ssl.keystore.location": str(keystore),
                           "ssl.keystore.password": store_password, "ssl.key.password": store_password,
                           "ssl.truststore.type": "PEM", "ssl.truststore.location": str(kafka.data_dir / "ca.pem")},
                          "--add-scram", f"SCRAM-SHA-256=[name={cls.USER},password={kafka._password}]")
            kafka.client_config.write_text("".join(f"{key}={value}\n" for key, value in kafka.client.items()))
            kafka.client_config.chmod(0o600)
            kafka.start()
        except BaseException:
            kafka.remove()
            raise
        return kafka

    @property
    def client_config(self) -> Path:
        """The :attr:`client` settings as a properties file (0600), for ``oncekit doctor`` and the
        reference pipeline (``[services] kafka_client_config``) and Kafka's own tools."""
        return self.data_dir / "client.properties"

    def state(self) -> dict[str, Any]:
        return {**super().state(), "password": self._password}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> KafkaService:
        return cls(Path(state["data_dir"]), state["port"], state["controller_port"], state["password"], state["pid"])


# The single broker's properties that name its client listener (PLAINTEXT there).
_CLIENT_LISTENER_KEYS = ("listeners", "advertised.listeners", "inter.broker.listener.name",
                         "listener.security.protocol.map")


def _sasl_ssl(value: str) -> str:
    """``value`` with the listener named PLAINTEXT renamed SASL_SSL and given that protocol; the
    controller's listener (CONTROLLER:PLAINTEXT, on loopback) stays as it is."""
    value = value.replace("PLAINTEXT:PLAINTEXT", "SASL_SSL:SASL_SSL").replace("PLAINTEXT://", "SASL_SSL://")
    return "SASL_SSL" if value == "PLAINTEXT" else value


class LocalPostgres(_LocalService, PostgresService):
    """A throwaway server; with ``tls`` (a CA's certificate and a server certificate in its data
    folder, see :meth:`create`) it accepts only TLS connections with scram-sha-256, and its DSN
    asks for ``sslmode=verify-full`` against that CA."""

    def __init__(self, data_dir: Path, port: int, password: str, pid: int | None = None, tls: bool = False,
                 max_prepared_transactions: int = MAX_PREPARED_TRANSACTIONS) -> None:
        self.data_dir, self.port, self._password, self.tls = data_dir, port, password, tls
        self.max_prepared_transactions = max_prepared_transactions
        self.dsn = f"postgresql://oncekit:{password}@127.0.0.1:{port}/oncekit"
        argv = [
            _postgres_bin("postgres"), "-D", str(data_dir / "data"), "-p", str(port), "-k", str(data_dir),
            "-c", "listen_addresses=127.0.0.1", "-c", f"max_prepared_transactions={max_prepared_transactions}",
            # fsync only matters for machine crashes; a killed server loses nothing without it.
            "-c", "fsync=off",
        ]
        if tls:
            self.dsn += f"?sslmode=verify-full&sslrootcert={quote(str(data_dir / 'ca.pem'))}"
            argv += ["-c", "ssl=on", "-c", f"ssl_cert_file={data_dir / 'server.pem'}",
                     "-c", f"ssl_key_file={data_dir / 'server.key'}"]
        # SIGINT is PostgreSQL's fast shutdown: SIGTERM's smart shutdown would wait for every
        # client (the sinks' pooled sessions) to disconnect first.
        self._process = _Process(_as_postgres_user(argv), data_dir / "server.log", pid, signal.SIGINT)

    @classmethod
    def create(cls, ca: CertificateAuthority | None = None,
               max_prepared_transactions: int = MAX_PREPARED_TRANSACTIONS) -> LocalPostgres:
        """A new cluster; with ``ca``, serving TLS with a certificate ``ca`` signs and refusing
        every connection that is not TLS with scram-sha-256 (pg_hba.conf has hostssl lines only)."""
        import secrets

        initdb = _postgres_bin("initdb")
        data_dir = Path(tempfile.mkdtemp(prefix="oncekit-postgres-"))
        password = secrets.token_urlsafe(16)
        pwfile = data_dir / "pwfile"
        pwfile.write_text(password)
        for path in (data_dir, pwfile):
            _chown_postgres(path)
        result = subprocess.run(
            _as_postgres_user([initdb, "-D", str(data_dir / "data"), "-U", "oncekit", f"--pwfile={pwfile}",
                               "-A", "scram-sha-256", "--encoding=UTF8", "--locale=C", "--no-sync"]),
            capture_output=True, text=True, check=False,
        )
        pwfile.unlink()
        if result.returncode != 0:
            raise ServiceError(f"postgres: initdb failed: {result.stderr.strip()[-300:]}")
        if ca is not None:
            _install_tls(data_dir, ca)
        postgres = cls(data_dir, free_port(), password, tls=ca is not None, max_prepared_transactions=max_prepared_transactions)
        postgres.start(database="postgres")
        with connect(postgres.database_dsn("postgres"), autocommit=True) as conn:
            conn.execute("CREATE DATABASE oncekit")
        return postgres

    def database_dsn(self, database: str) -> str:
        """The DSN of another database of this server."""
        return make_conninfo(self.dsn, dbname=database)

    def start(self, database: str = "oncekit") -> None:
        if port_in_use(self.port):
            raise ServiceError(f"postgres: port {self.port} on 127.0.0.1 is in use")
        self._process.launch()
        logger.info("postgres: local server pid %s on port %s", self._process.pid, self.port)
        time.sleep(0.3)
        if not self._process.alive():
            raise ServiceError(f"postgres: local server exited at start: {self._process.log_tail()}")
        dsn = self.database_dsn(database)
        wait_until(lambda: check_server(dsn), 60, f"postgres at {redact_dsn(dsn)}")

    def state(self) -> dict[str, Any]:
        return {"data_dir": str(self.data_dir), "port": self.port, "password": self._password,
                "pid": self._process.pid, "tls": self.tls, "max_prepared_transactions": self.max_prepared_transactions}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> LocalPostgres:
        return cls(Path(state["data_dir"]), state["port"], state["password"], state["pid"], state.get("tls", False),
                   state.get("max_prepared_transactions", MAX_PREPARED_TRANSACTIONS))


def _install_tls(data_dir: Path, ca: CertificateAuthority) -> None:
    """The server's certificate and key (the key readable by the server's user alone, as
    PostgreSQL demands), the CA clients verify it with, and a pg_hba.conf that takes TLS with
    scram-sha-256 only (no ``host`` line, so a plain connection finds no entry)."""
    issued = ca.issue("postgres")
    shutil.copy(ca.certificate, data_dir / "ca.pem")
    shutil.copy(issued.certificate, data_dir / "server.pem")
    shutil.copy(issued.key, data_dir / "server.key")
    os.chmod(data_dir / "server.key", 0o600)
    hba = data_dir / "data" / "pg_hba.conf"
    hba.write_text("local all all scram-sha-256\n"
                   "hostssl all all 127.0.0.1/32 scram-sha-256\n"
                   "hostssl all all ::1/128 scram-sha-256\n")
    for path in (data_dir / "server.pem", data_dir / "server.key", hba):
        _chown_postgres(path)

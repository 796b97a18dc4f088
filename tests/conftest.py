"""Shared fixtures: real services started once per session, a fresh topic and table per test.

``ONCEKIT_TEST_BACKEND`` picks the services backend (containers, local, external, auto; the
Makefile sets containers). A service that cannot start fails the run: nothing here skips.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# Crash points read this once, at import, in every process: set it before Spark starts workers.
# Each pytest-xdist worker has its own (a worker inherits the controller's environment, and a
# point armed by one worker's test must never fire in the other's pipeline).
if "PYTEST_XDIST_WORKER" in os.environ or "ONCEKIT_CRASH_DIR" not in os.environ:
    os.environ["ONCEKIT_CRASH_DIR"] = tempfile.mkdtemp(prefix="oncekit-crash-")

# The suite's JVMs (Spark's drivers, spark-submit's, the Connect server, a standalone master and
# worker, the brokers) compile with C1 only and collect with one thread: each lives seconds to
# minutes, too short for C2's compiles to pay back, and two test workers share two cores. The
# transactional Kafka sink's crash cases took 164 CPU-s so against 196 with the JVM's defaults; a
# broker's start and 20 transactional topics 9 against 17. A user's job keeps its own settings.
SHORT_LIVED_JVM = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
for _variable in ("SPARK_SUBMIT_OPTS", "SPARK_DAEMON_JAVA_OPTS", "KAFKA_JVM_PERFORMANCE_OPTS"):
    os.environ.setdefault(_variable, SHORT_LIVED_JVM)

import pytest  # noqa: E402

from oncekit.connectors import KafkaConfig, Services, start_services  # noqa: E402
from oncekit.connectors.kafka_admin import create_topic  # noqa: E402
from tests.sizes import FULL_SIZE_ENV, full_size  # noqa: E402


@pytest.fixture(scope="session")
def services() -> Iterator[Services]:
    started = start_services(os.environ.get("ONCEKIT_TEST_BACKEND", "auto"))
    with started.running():
        yield started


@pytest.fixture(scope="session")
def kafka(services: Services) -> KafkaConfig:
    return KafkaConfig(services.kafka.bootstrap_servers)


@pytest.fixture(scope="session")
def postgres_dsn(services: Services) -> str:
    return services.postgres.dsn


@pytest.fixture
def unique_name(request: pytest.FixtureRequest) -> str:
    """A name no other test uses: the test's own name plus a random suffix."""
    base = "".join(c if c.isalnum() else "_" for c in request.node.name.lower())[:40]
    return f"{base}_{uuid.uuid4().hex[:8]}"


@pytest.fixture
def topic(kafka: KafkaConfig, unique_name: str) -> str:
    """A fresh two-partition topic for one test."""
    name = unique_name.replace("_", "-")
    create_topic(kafka, name, partitions=2)
    return name


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    from oncekit.core.spark.session import spark_session
    from oncekit.sources.kafka import register

    # Spark's own Kafka connector too (the crash-point tests read through either), fetched by
    # make test before pytest starts (docker/spark-kafka/fetch.sh)
    from benchmarks.environment import spark_kafka_connector

    session = spark_session("oncekit-tests", conf={"spark.ui.enabled": "false",
                                                   "spark.jars": ",".join(spark_kafka_connector().jars)})
    register(session)
    yield session
    session.stop()


ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The kit's wheel, built from a copy of the checkout (setuptools leaves build/ and
    *.egg-info beside the sources it builds) by the getting-started page's first command
    (``make wheel``): ``<copy>/dist/oncekit-<version>-py3-none-any.whl``."""
    from tests.docs.console import console_commands

    source = tmp_path_factory.mktemp("wheel") / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".venv", ".oncekit", ".git", "target", "__pycache__",
                                                                "dist", "build"))
    build = console_commands("install")[0]
    subprocess.run(["bash", "-c", build], cwd=source, check=True,
                   env={**os.environ, "PYTHON": sys.executable, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    (built,) = (source / "dist").glob("oncekit-*.whl")
    return built


@pytest.fixture(scope="module")
def spark_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A Spark standalone cluster (a master and a worker of two cores) for one module's tests."""
    from oncekit.connectors.services.spark_cluster import StandaloneCluster

    standalone = StandaloneCluster(tmp_path_factory.mktemp("spark-cluster"), cores=2)
    standalone.start()
    yield standalone
    standalone.stop()


@pytest.fixture
def crash_dir() -> Iterator[Path]:
    """The crash-point folder, empty before and after the test (an armed point that did not
    fire must not fire in a later test)."""
    directory = Path(os.environ["ONCEKIT_CRASH_DIR"])

    def clear() -> None:
        for path in directory.glob("*"):
            path.unlink()

    clear()
    yield directory
    clear()


class CampaignTables(list[str]):
    """Fault-campaign tables, printed in the terminal summary (CI's log keeps them). Each is also
    written to a file: ``make test`` runs two pytest-xdist workers, and the summary is printed by
    the controlling process, which ran no campaign."""

    directory: Path | None = None

    def append(self, text: str) -> None:
        super().append(text)
        if self.directory is not None:
            (self.directory / f"{time.time():.6f}-{os.getpid()}.txt").write_text(text)


_CAMPAIGN_TABLES = CampaignTables()
_TABLES_ENV = "ONCEKIT_CAMPAIGN_TABLES_DIR"
SEED_ENV = "ONCEKIT_VERIFY_SEED"


def pytest_configure(config: pytest.Config) -> None:
    # The controller (or a run without workers) makes the folder and draws the run's seed; xdist's
    # workers, started after this, inherit both. One folder per run: other runs in the same tree
    # keep theirs. The seed changes with every run, so that runs cover more faults over time than
    # any one run; each run prints it, and setting it runs the same faults again.
    if not hasattr(config, "workerinput"):
        os.environ[_TABLES_ENV] = tempfile.mkdtemp(prefix="oncekit-campaign-tables-")
        os.environ.setdefault(SEED_ENV, str(random.SystemRandom().randrange(1, 1_000_000)))
    CampaignTables.directory = Path(os.environ[_TABLES_ENV])


def pytest_report_header(config: pytest.Config) -> str:
    return f"oncekit: faults drawn from {SEED_ENV}={os.environ[SEED_ENV]} (set it to run the same faults again)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist, the tests that share a module-scoped fixture (a three-broker cluster,
    secured services, a Spark standalone cluster) run in one worker, which starts it once. Tests
    marked ``long`` go first, longest first: xdist hands the first tests to its workers in turn,
    so the longest ones run side by side instead of one after another at the end of the run.
    Tests marked ``full_size`` are skipped unless ``ONCEKIT_FULL_SIZE=1`` (``make test-long``)."""
    def expected_s(item: pytest.Item) -> float:
        marker = item.get_closest_marker("long")
        return float(marker.args[0]) if marker is not None else 0.0

    items.sort(key=expected_s, reverse=True)  # stable: the others keep their order
    if not full_size():
        skip = pytest.mark.skip(reason=f"a full-size campaign: make test-long runs it ({FULL_SIZE_ENV}=1)")
        for item in items:
            if item.get_closest_marker("full_size") is not None:
                item.add_marker(skip)
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        if info is not None and any(d.scope == "module" for defs in info.name2fixturedefs.values() for d in defs):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


@pytest.fixture(scope="session")
def campaign_tables() -> list[str]:
    return _CAMPAIGN_TABLES


def pytest_terminal_summary(terminalreporter: Any) -> None:
    directory = CampaignTables.directory
    files = sorted(directory.glob("*.txt")) if directory is not None else []
    if files:
        terminalreporter.section("oncekit verify campaigns")
        for path in files:
            terminalreporter.write_line(path.read_text() + "\n")
    terminalreporter.write_line(f"oncekit: this run's faults were drawn from {SEED_ENV}={os.environ.get(SEED_ENV)}")

"""The JVM peers: Kafka Streams and Flink copying one topic into another, each a Java program of
benchmarks/jvm/ run in a JVM of its own (benchmarks/jvm/build.sh builds it with Maven).

Both take the same arguments (servers, source, target, records, guarantee, the commit or
checkpoint interval in ms, parallelism). With records above 0 they copy that many and print the
seconds they took; with 0 they run until their standard input ends (the latency group).
"""

from __future__ import annotations

import select
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from benchmarks.peers import Timed

HERE = Path(__file__).resolve().parent / "jvm"
BUILD = HERE / "build.sh"
READY_S = 120.0
"""How long a peer may take from its JVM's start to running its copy (Kafka Streams' group join,
Flink's MiniCluster and job start)."""


@dataclass(frozen=True)
class JvmPeer:
    """``project`` is the folder under benchmarks/jvm/; ``jar`` names the jar of its libs whose
    version the tables print."""

    name: str
    project: str
    main: str
    jar: str

    def classpath(self) -> str:
        """Builds the peer where its build is missing or stale; its class path."""
        built = subprocess.run([str(BUILD), self.project], capture_output=True, text=True, check=False)
        if built.returncode:
            raise RuntimeError(built.stderr.strip().splitlines()[-1] if built.stderr.strip() else f"{BUILD} failed")
        target = HERE / self.project / "target"
        return f"{target / 'classes'}:{target / 'libs' / '*'}"

    def version(self) -> str:
        """The peer's version from its jar's name (after :meth:`classpath` built it)."""
        jars = sorted((HERE / self.project / "target" / "libs").glob(f"{self.jar}-[0-9]*.jar"))
        return jars[-1].stem[len(self.jar) + 1:] if jars else "not built"

    def command(self, servers: str, source: str, target: str, records: int, guarantee: str, interval_ms: int,
                parallelism: int) -> list[str]:
        return ["java", "-cp", self.classpath(), self.main, servers, source, target, str(records), guarantee,
                str(interval_ms), str(parallelism)]

    def copy(self, servers: str, source: str, target: str, records: int, guarantee: str, interval_ms: int,
             parallelism: int) -> Timed:
        """Copy ``records`` records from ``source`` into ``target`` (which exists) and stop."""
        ran = subprocess.run(self.command(servers, source, target, records, guarantee, interval_ms, parallelism),
                             capture_output=True, text=True, check=False, timeout=3600)
        if ran.returncode:
            raise RuntimeError(f"{self.name} failed (exit {ran.returncode}): {last_error(ran.stderr)}")
        figures = [float(f) for f in ran.stdout.strip().splitlines()[-1].split()]
        return Timed(figures[0], figures[1] if len(figures) > 1 else None)

    @contextmanager
    def running(self, servers: str, source: str, target: str, guarantee: str, interval_ms: int,
                parallelism: int) -> Iterator[None]:
        """The peer copying ``source`` into ``target`` as records arrive, until the block ends;
        a peer not running its copy within :data:`READY_S` fails with its last error line."""
        with tempfile.TemporaryFile("w+") as errors:
            process = subprocess.Popen(self.command(servers, source, target, 0, guarantee, interval_ms, parallelism),
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors, text=True)
            assert process.stdout is not None and process.stdin is not None
            try:
                readable, _, _ = select.select([process.stdout], [], [], READY_S)
                if not readable or process.stdout.readline().strip() != "ready":
                    process.kill()
                    process.wait()
                    errors.seek(0)
                    raise RuntimeError(f"{self.name} did not start copying {source} within {READY_S:.0f} s "
                                       f"(exit {process.returncode}): {last_error(errors.read())}")
                yield
            finally:
                process.stdin.close()  # the peer's signal to stop
                try:
                    process.wait(60)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()


def last_error(stderr: str) -> str:
    """The first line of a JVM's standard error that names an exception, else its last 300 characters."""
    lines = [line for line in stderr.strip().splitlines() if "Exception" in line or "Error" in line]
    return lines[0] if lines else stderr.strip()[-300:]


KAFKA_STREAMS = JvmPeer("Kafka Streams", "kafka-streams", "dev.oncekit.bench.StreamsCopy", "kafka-streams")
FLINK = JvmPeer("Flink", "flink", "dev.oncekit.bench.FlinkCopy", "flink-core")
FLINK_KAFKA = "flink-connector-kafka"


def describe() -> str:
    """The peers' versions, for a table's notes (building them first: a failed build is said here
    and fails their rows)."""
    try:
        for peer in (KAFKA_STREAMS, FLINK):
            peer.classpath()
    except RuntimeError as exc:
        return f"The JVM peers could not be built: {exc}"
    connector = sorted((HERE / FLINK.project / "target" / "libs").glob(f"{FLINK_KAFKA}-[0-9]*.jar"))
    return (f"Kafka Streams {KAFKA_STREAMS.version()}; Flink {FLINK.version()} with its Kafka connector "
            f"{connector[-1].stem[len(FLINK_KAFKA) + 1:] if connector else 'not built'}, in a local MiniCluster; "
            "each in a JVM of its own (benchmarks/jvm/)")

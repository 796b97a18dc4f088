"""What every group shares: the options, the services, one Spark session that has Spark's own
Kafka connector on its class path, and the input topics.

One session serves the kit and its Spark peers alike, so both sides run in the same JVM with the
same settings, one case after the other. Spark's connector is fetched from Maven Central by
docker/spark-kafka/fetch.sh for the running pyspark's version.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks import data
from oncekit.connectors import KafkaConfig, Services, start_services
from oncekit.core.spark.session import spark_session

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

ROOT = Path(__file__).resolve().parent.parent
FETCH = ROOT / "docker" / "spark-kafka" / "fetch.sh"
QUIX_VENV_PYTHON = ROOT / ".oncekit" / "quix-venv" / "bin" / "python"
GROUPS = ("source", "kafka", "postgres", "latency", "reference", "state", "recovery", "fanout", "partitions")


def default_quix_python() -> str:
    return sys.executable if importlib.util.find_spec("quixstreams") else str(QUIX_VENV_PYTHON)


@dataclass(frozen=True)
class Options:
    records: int
    record_bytes: int
    partitions: int
    per_batch: int
    warmup: int
    rate: int
    latency_s: float
    groups: tuple[str, ...]
    backend: str
    quix_python: str
    reference_rate: int = 5_000
    rounds: int = 1
    kills: int = 1

    @classmethod
    def parse(cls, argv: list[str] | None = None) -> Options:
        parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                         formatter_class=argparse.RawDescriptionHelpFormatter)
        parser.add_argument("--records", type=int, default=1_000_000, help="input records (default 1,000,000)")
        parser.add_argument("--record-bytes", type=int, default=100, help="size of a record's value (default 100)")
        parser.add_argument("--partitions", type=int, default=2, help="partitions of every topic (default 2)")
        parser.add_argument("--per-batch", type=int, default=250_000,
                            help="maxOffsetsPerTrigger of both sources (default 250,000)")
        parser.add_argument("--warmup", type=int, default=20_000,
                            help="records each case runs right before each measured run (0: no warm-up; default 20,000)")
        parser.add_argument("--rate", type=int, default=2_000, help="latency group: records a second (default 2,000)")
        parser.add_argument("--latency-seconds", type=float, default=15.0,
                            help="latency and reference groups: how long input is produced (default 15)")
        parser.add_argument("--reference-rate", type=int, default=5_000,
                            help="reference group: payment events a second in its latency run (default 5,000)")
        parser.add_argument("--rounds", type=int, default=1,
                            help="throughput groups: measured runs of every case, in turn; a case's figure is "
                                 "its fastest (default 1, so that make bench stays under 20 minutes)")
        parser.add_argument("--kills", type=int, default=1,
                            help="recovery group: kill -9 of each case's driver, one after another; with more than "
                                 "one, the median and maximum of each step (default 1)")
        parser.add_argument("--groups", default=",".join(GROUPS), help=f"comma-separated, of {', '.join(GROUPS)}")
        parser.add_argument("--backend", default="auto", help="services: auto, containers, local or external")
        parser.add_argument("--quix-python", default=None,
                            help="an interpreter with quixstreams (default: this one if it has it, else "
                                 ".oncekit/quix-venv/bin/python, which make bench installs)")
        args = parser.parse_args(argv)
        groups = tuple(g.strip() for g in args.groups.split(",") if g.strip())
        unknown = sorted(set(groups) - set(GROUPS))
        if unknown:
            parser.error(f"unknown group {', '.join(unknown)}; choose from {', '.join(GROUPS)}")
        for name in ("records", "record_bytes", "partitions", "per_batch", "rate", "latency_seconds", "reference_rate",
                     "rounds", "kills"):
            if getattr(args, name) <= 0:
                parser.error(f"--{name.replace('_', '-')} must be positive")
        return cls(args.records, args.record_bytes, args.partitions, args.per_batch, max(0, args.warmup), args.rate,
                   args.latency_seconds, groups, args.backend, args.quix_python or default_quix_python(),
                   args.reference_rate, args.rounds, args.kills)

    def describe(self) -> str:
        return (f"{self.records:,} records of {self.record_bytes} bytes, {self.partitions} partitions, "
                f"{self.per_batch:,} per batch")


@dataclass(frozen=True)
class Connector:
    """Spark's Kafka connector jars and the version they are (Maven Central may lack pyspark's)."""

    jars: tuple[str, ...]
    version: str
    pyspark: str

    def describe(self) -> str:
        if self.version == self.pyspark:
            return f"Spark's Kafka connector {self.version}"
        return (f"Spark's Kafka connector {self.version} on pyspark {self.pyspark} "
                f"(Maven Central has no spark-sql-kafka-0-10 {self.pyspark})")


def spark_kafka_connector() -> Connector:
    import pyspark

    fetched = subprocess.run([str(FETCH), pyspark.__version__], capture_output=True, text=True, check=False)
    if fetched.returncode:
        raise RuntimeError(fetched.stderr.strip() or f"{FETCH} failed")
    jars = tuple(sorted(str(p) for p in Path(fetched.stdout.strip().splitlines()[-1]).glob("*.jar")))
    prefix = "spark-sql-kafka-0-10_2.13-"
    version = next(Path(j).stem[len(prefix):] for j in jars if Path(j).name.startswith(prefix))
    return Connector(jars, version, pyspark.__version__)


@dataclass(frozen=True)
class Bench:
    options: Options
    services: Services
    kafka: KafkaConfig
    spark: SparkSession
    connector: Connector
    measured: data.Input
    warmup: data.Input | None

    @property
    def servers(self) -> str:
        return self.kafka.bootstrap_servers

    @property
    def dsn(self) -> str:
        return self.services.postgres.dsn


MAX_PREPARED_TRANSACTIONS = 300
"""The bench's PostgreSQL server's: the partitions group's two-phase commit holds up to two
batches of 128 writer partitions prepared at once."""


@contextmanager
def bench(options: Options) -> Iterator[Bench]:
    """Services, the session and the inputs; everything is stopped and removed on the way out."""
    connector = spark_kafka_connector()
    with start_services(options.backend, max_prepared_transactions=MAX_PREPARED_TRANSACTIONS).running() as services:
        kafka = KafkaConfig(services.kafka.bootstrap_servers)
        measured = data.produce(kafka, "measured", options.records, options.record_bytes, options.partitions)
        warmup = (data.produce(kafka, "warmup", options.warmup, options.record_bytes, options.partitions)
                  if options.warmup else None)
        spark = spark_session("oncekit-bench", conf={
            "spark.jars": ",".join(connector.jars),
            "spark.sql.streaming.numRecentProgressUpdates": "100000",  # the noop cases count input from progress
            "spark.ui.enabled": "false",  # no UI's work in the measurement
        })
        spark.sparkContext.setLogLevel("ERROR")  # the tables, not Spark's warnings about re-registered sources
        try:
            yield Bench(options, services, kafka, spark, connector, measured, warmup)
        finally:
            spark.stop()

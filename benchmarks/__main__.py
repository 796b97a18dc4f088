"""``python -m benchmarks`` (``make bench``): every group in one run, on one broker and one
database, each kit case beside its peers on the same input. See benchmarks/__init__.py."""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version

from benchmarks.cases import fanout_group, kafka_group, postgres_group, source_group
from benchmarks.environment import Bench, Options, bench
from benchmarks.latency import latency_group
from benchmarks.output import report_only
from benchmarks.partitions import partitions_group
from benchmarks.recovery import recovery_group
from benchmarks.reference import reference_pipeline
from benchmarks.state import state_group
from benchmarks.table import Table

GROUPS: dict[str, Callable[[Bench], Table]] = {
    "source": source_group,
    "kafka": kafka_group,
    "postgres": postgres_group,
    "latency": latency_group,
    "reference": lambda b: reference_pipeline(b.services, b.options),
    "state": state_group,
    "recovery": recovery_group,
    "fanout": fanout_group,
    "partitions": partitions_group,
}


def installed(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


SPARK_OUTPUT = os.path.join(".oncekit", "bench", "spark-output.log")
"""Where what Spark's JVM and pyspark's workers print goes, out of the report."""
REPORT = os.path.join(".oncekit", "bench", "report.md")
"""The run's report as Markdown, as printed; docs/benchmarks.md shows a copy (docs/bench/last-run.md)."""


def main(argv: list[str] | None = None) -> int:
    options = Options.parse(argv)
    with report_only(SPARK_OUTPUT):
        print(f"# Spark's and pyspark's own output: {SPARK_OUTPUT}", flush=True)
        return _run(options)


def _run(options: Options) -> int:
    began = time.monotonic()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    printed: list[str] = []

    def say(text: str) -> None:
        print(text, flush=True)
        printed.append(text)

    with bench(options) as b:
        say(f"# {time.strftime('%Y-%m-%d')}: set-up (services, input, Spark session) {time.monotonic() - began:.0f} s")
        say(f"# oncekit benchmarks: {options.describe()}; Spark {b.spark.sparkContext.master} on "
            f"{os.cpu_count()} cores; services: {b.services.backend}; pyspark {installed('pyspark')}, "
            f"confluent-kafka {installed('confluent-kafka')}; "
            f"warm-up {options.warmup:,} records before each measured run; throughput figures are the fastest of "
            f"{options.rounds} round{'s' if options.rounds > 1 else ''}.")
        say("# A shared machine is noisy: compare the rows of one run, not runs.")
        for name in options.groups:
            started = time.monotonic()
            say(GROUPS[name](b).render())
            say(f"# group {name}: {time.monotonic() - started:.0f} s")
    say(f"# all: {time.monotonic() - began:.0f} s")
    with open(REPORT, "w") as report:
        report.write(markdown(printed))
    print(f"# the report as Markdown: {REPORT}", flush=True)
    return 0


def markdown(printed: list[str]) -> str:
    """What the run printed, as a Markdown page's body: its comment lines (``# ...``) become
    paragraphs, its tables stay as they are."""
    return "\n".join(f"\n{text[2:]}\n" if text.startswith("# ") else text for text in printed) + "\n"


if __name__ == "__main__":
    sys.exit(main())

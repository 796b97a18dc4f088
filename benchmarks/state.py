"""6. State checkpoints: RocksDB changelog checkpointing (the kit's session default) beside
Spark's default, a snapshot of the state store uploaded at every batch.

Each case runs the same stateful query for ten batches of ``options.records / 10`` rows each:
Spark's ``rate-micro-batch`` source (a JVM source, so the figures are the state store's and not
a Python worker's), deduplicated by value with ``dropDuplicates`` (the state grows by one key
per record, as the reference pipeline's event-id dedup does), into Spark's noop sink. Figures per case, from the queries' progress and the checkpoint folder:
the state commit time per batch (``commitTimeMs`` of the stateful operator; median and p90
over the batches after the first), and the checkpoint's size on disk after the run, state
and logs together.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks.cases import failure
from benchmarks.latency import percentile
from benchmarks.table import Check, Ratio, Row, Table
from oncekit.core.spark.session import CHANGELOG_CHECKPOINTING

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from benchmarks.environment import Bench

BATCHES = 10
CASES = {"changelog checkpointing (kit default)": "true", "snapshot per batch (Spark default)": "false"}


def _size_mb(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 1e6


def _run(spark: SparkSession, records: int, changelog: str) -> dict[str, float]:
    previous = spark.conf.get(CHANGELOG_CHECKPOINTING)
    spark.conf.set(CHANGELOG_CHECKPOINTING, changelog)  # each query takes the session's value when it starts
    try:
        with tempfile.TemporaryDirectory() as checkpoint:
            frame = spark.readStream.format("rate-micro-batch").option("rowsPerBatch", max(1, records // BATCHES)).load()
            query = (frame.select("value").dropDuplicates(["value"]).writeStream.format("noop")
                     .option("checkpointLocation", checkpoint).trigger(processingTime="0 seconds").start())
            try:
                while len(query.recentProgress) < BATCHES and query.exception() is None:
                    time.sleep(0.2)
            finally:
                query.stop()
            if query.exception() is not None:
                raise RuntimeError(str(query.exception()))
            progress = query.recentProgress[:BATCHES]
            commits = sorted(float(p["stateOperators"][0]["commitTimeMs"]) for p in progress[1:])
            return {"records": float(sum(int(p["numInputRows"]) for p in progress)), "batches": float(len(progress)),
                    "commit p50 ms": statistics.median(commits), "commit p90 ms": percentile(commits, 0.9),
                    "checkpoint MB": _size_mb(Path(checkpoint))}
    finally:
        spark.conf.set(CHANGELOG_CHECKPOINTING, previous or "false")


def state_group(bench: Bench) -> Table:
    table = Table("6. State checkpoints", ("batches", "commit p50 ms", "commit p90 ms", "checkpoint MB"),
                  ("commit p50 ms", "commit p90 ms", "checkpoint MB"), "below 1: changelog is cheaper",
                  notes=[f"rate-micro-batch source, {bench.options.records // BATCHES:,} rows a batch, dropDuplicates by "
                         f"value, RocksDB state store, noop sink, {BATCHES} batches; commit time of the stateful "
                         f"operator per batch after the first; checkpoint size after the last."])
    for case, changelog in CASES.items():
        try:
            figures = _run(bench.spark, bench.options.records, changelog)
        except Exception as exc:  # a failed case is a row that says why, the other still runs
            table.rows.append(Row.failed(case, failure(exc)))
            continue
        check = Check(BATCHES * max(1, bench.options.records // BATCHES), int(figures.pop("records")), None)
        table.rows.append(Row(case, figures if check.ok else {}, str(check)))
    table.ratios.append(Ratio(*CASES))
    return table

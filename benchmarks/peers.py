"""The pipelines the kit is measured against, each as a user would write it.

- Spark's own Kafka source and sink (the JVM connector, ``format("kafka")``): at-least-once.
- A hand-written ``foreachBatch`` that COPYs each micro-batch into PostgreSQL as Arrow-rendered
  CSV, one connection per task: at-least-once.
- Quix Streams copying one topic into another, exactly-once or at-least-once, in its own process
  (benchmarks/quix.py; a missing install fails its row only).
- Kafka Streams and Flink copying one topic into another, each in a JVM of its own
  (benchmarks/jvm.py).
"""

from __future__ import annotations

import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.streaming.readwriter import DataStreamWriter

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Timed:
    """What a case returns when it timed itself (a pipeline in a process of its own, whose
    start-up and imports are not the pipeline's time): its seconds, and (Flink) the seconds from
    its first record read to its end, without its engine's and its job's start-up."""

    seconds: float
    from_first_record: float | None = None


def spark_kafka_stream(spark: SparkSession, servers: str, topic: str, per_batch: int | None = None) -> DataFrame:
    """Spark's JVM Kafka source, reading committed records only, like the kit's source."""
    reader = (spark.readStream.format("kafka").option("kafka.bootstrap.servers", servers).option("subscribe", topic)
              .option("startingOffsets", "earliest").option("kafka.isolation.level", "read_committed"))
    if per_batch is not None:
        reader = reader.option("maxOffsetsPerTrigger", str(per_batch))
    return reader.load()


def spark_kafka_sink(frame: DataFrame, servers: str, topic: str) -> DataStreamWriter:
    """Spark's JVM Kafka sink (at-least-once) for a frame with key and value columns."""
    return (frame.select("key", "value").writeStream.format("kafka")
            .option("kafka.bootstrap.servers", servers).option("topic", topic))


def run_available(writer: DataStreamWriter) -> int:
    """Run a plain Spark query over all available input; the number of input rows it processed."""
    with tempfile.TemporaryDirectory() as checkpoint:
        query = writer.option("checkpointLocation", checkpoint).trigger(availableNow=True).start()
        query.awaitTermination()
        return sum(int(p["numInputRows"]) for p in query.recentProgress)


def foreach_batch_copy(frame: DataFrame, dsn: str, table: str) -> DataStreamWriter:
    """Every micro-batch COPYed into ``table``: each task renders its Arrow batches with
    pyarrow.csv and streams them into ``COPY ... FROM STDIN (FORMAT csv)``."""

    def write(batch: DataFrame, batch_id: int) -> None:
        def copy_partition(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
            import io

            import psycopg
            import pyarrow as pa
            import pyarrow.csv as pacsv

            rows = 0
            options = pacsv.WriteOptions(include_header=False)
            with psycopg.connect(dsn) as conn, conn.cursor() as cur, \
                    cur.copy(f"COPY {table} FROM STDIN (FORMAT csv)") as copy:
                for arrow in batches:
                    out = io.BytesIO()
                    pacsv.write_csv(arrow, out, options)
                    copy.write(out.getvalue())
                    rows += arrow.num_rows
            yield pa.RecordBatch.from_pydict({"rows": [rows]})

        batch.mapInArrow(copy_partition, "rows long").collect()

    return frame.writeStream.foreachBatch(write)


def quix_copy(python: str, servers: str, source: str, target: str, records: int, guarantee: str) -> Timed:
    """Quix Streams copies ``records`` records from ``source`` to ``target`` (which exists) with
    ``guarantee`` ("exactly-once" or "at-least-once"), in a process of ``python`` (an interpreter
    with quixstreams); the seconds the copy took in that process."""
    if not Path(python).exists():
        raise RuntimeError(f"quixstreams cannot run: no {python} (make bench installs the bench extra there)")
    ran = subprocess.run([python, "-m", "benchmarks.quix", servers, source, target, str(records), guarantee],
                         cwd=ROOT, capture_output=True, text=True, check=False, timeout=3600)
    if ran.returncode:
        lines = ran.stderr.strip().splitlines()
        raise RuntimeError(f"Quix Streams ({python}) failed: {lines[-1] if lines else ran.returncode}")
    return Timed(float(ran.stdout.strip().splitlines()[-1]))

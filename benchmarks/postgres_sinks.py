"""Rows per second of each PostgreSQL sink, beside a plain foreachBatch INSERT, in one run.

    .venv/bin/python benchmarks/postgres_sinks.py [--rows 1000000] [--backend auto]

Every case reads the same Kafka topic (rows of id, account, amount, note) with oncekit's source
and writes it into an empty table; the source alone into Spark's noop sink is the ceiling.
Figures on a shared machine are noisy: compare the rows of one run, not runs.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from typing import Any

import psycopg
from confluent_kafka import Producer

from oncekit.connectors import KafkaConfig, start_services
from oncekit.connectors.kafka import create_topic
from oncekit.core.spark.query import start_query
from oncekit.core.spark.session import spark_session
from oncekit.sinks.postgres import postgres_sink
from oncekit.sources.kafka import kafka_stream

TOPIC = "bench-postgres"
COLUMNS = "id bigint NOT NULL, account int NOT NULL, amount bigint NOT NULL, note text"


def produce(kafka: KafkaConfig, rows: int) -> None:
    create_topic(kafka, TOPIC, partitions=2)
    producer = Producer(kafka.settings(linger_ms=50, batch_num_messages=10000, compression_type="lz4"))
    for i in range(rows):
        producer.produce(TOPIC, value=f"{i},{i % 1000},{i * 7 % 10000},note-{i}".encode(), partition=i % 2)
        if i % 100_000 == 0:
            producer.flush()
    producer.flush()


def frame(spark: Any, kafka: KafkaConfig, per_batch: int) -> Any:
    return (
        kafka_stream(spark, kafka.bootstrap_servers, TOPIC, max_offsets_per_trigger=per_batch)
        .selectExpr("split(CAST(value AS STRING), ',') AS f")
        .selectExpr("CAST(f[0] AS BIGINT) AS id", "CAST(f[1] AS INT) AS account", "CAST(f[2] AS BIGINT) AS amount",
                    "f[3] AS note")
    )


def fresh_table(dsn: str, name: str, keyed: bool) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"DROP TABLE IF EXISTS {name}")
        conn.execute(f"CREATE TABLE {name} ({COLUMNS}{', PRIMARY KEY (id)' if keyed else ''})")


def count(dsn: str, table: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(f"SELECT count(*) FROM {table}").fetchone()
        return int(row[0]) if row else 0


def timed(run: Any) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--per-batch", type=int, default=250_000)
    parser.add_argument("--backend", default="auto")
    args = parser.parse_args()

    with start_services(args.backend).running() as services:
        kafka, dsn = KafkaConfig(services.kafka.bootstrap_servers), services.postgres.dsn
        produce(kafka, args.rows)
        spark = spark_session("oncekit-bench")
        results: list[tuple[str, float, int]] = []

        def noop() -> None:
            with tempfile.TemporaryDirectory() as checkpoint:
                frame(spark, kafka, args.per_batch).writeStream.format("noop").option("checkpointLocation", checkpoint) \
                    .trigger(availableNow=True).start().awaitTermination()

        noop()  # warm-up: the session's first query pays for starting Python workers
        results.append(("source only (noop sink)", timed(noop), args.rows))

        def plain_insert() -> None:
            def write(batch: Any, batch_id: int) -> None:
                def insert(rows: Any) -> None:
                    with psycopg.connect(dsn) as conn, conn.cursor() as cur:
                        cur.executemany("INSERT INTO bench_plain VALUES (%s, %s, %s, %s)", [tuple(r) for r in rows])
                batch.foreachPartition(insert)

            fresh_table(dsn, "bench_plain", keyed=False)
            with tempfile.TemporaryDirectory() as checkpoint:
                frame(spark, kafka, args.per_batch).writeStream.foreachBatch(write) \
                    .option("checkpointLocation", checkpoint).trigger(availableNow=True).start().awaitTermination()

        results.append(("foreachBatch + executemany INSERT", timed(plain_insert), count(dsn, "bench_plain")))

        for protocol in ("two-phase-commit", "write-ahead-log", "idempotent", "at-least-once"):
            table = "bench_" + protocol.replace("-", "_")
            keyed = protocol == "idempotent"
            fresh_table(dsn, table, keyed)
            sink = postgres_sink(dsn, table, protocol, key_columns=("id",) if keyed else ())

            def run(sink: Any = sink) -> None:
                with tempfile.TemporaryDirectory() as checkpoint:
                    start_query(frame(spark, kafka, args.per_batch), sink, checkpoint,
                                trigger={"availableNow": True}).await_termination()

            results.append((f"oncekit {protocol}", timed(run), count(dsn, table)))
        spark.stop()

    print(f"\n{args.rows:,} rows from Kafka ({args.per_batch:,} per batch), 2 partitions, Spark local[*]")
    print(f"| {'sink':<36} | {'seconds':>8} | {'rows written':>12} | {'rows/s':>9} |")
    print(f"|{'-' * 38}|{'-' * 10}|{'-' * 14}|{'-' * 11}|")
    for name, seconds, written in results:
        print(f"| {name:<36} | {seconds:>8.1f} | {written:>12,} | {written / seconds:>9,.0f} |")


if __name__ == "__main__":
    main()

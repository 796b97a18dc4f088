"""Records per second of the Kafka source alone and of Kafka into Kafka with each Kafka sink,
beside raw confluent-kafka consume and produce loops (the ceiling), in one run.

    .venv/bin/python benchmarks/kafka.py [--records 1000000] [--backend auto]

Records are 100-byte values over two partitions. Figures on a shared machine are noisy: compare
the rows of one run, not runs.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from typing import Any

from confluent_kafka import Consumer, Producer, TopicPartition

from oncekit.connectors import KafkaConfig, start_services
from oncekit.connectors.kafka import create_topic
from oncekit.core.spark.query import start_query
from oncekit.core.spark.session import spark_session
from oncekit.sinks.kafka import kafka_sink
from oncekit.sources.kafka import kafka_stream

TOPIC = "bench-kafka-in"


def raw_produce(kafka: KafkaConfig, topic: str, records: int) -> None:
    producer = Producer(kafka.settings(linger_ms=20, batch_num_messages=10000))
    value = b"x" * 100
    for i in range(records):
        while True:
            try:
                producer.produce(topic, value=value, key=str(i).encode(), partition=i % 2)
                break
            except BufferError:
                producer.poll(0.05)
    producer.flush()


def raw_consume(kafka: KafkaConfig, topic: str, records: int) -> None:
    consumer = Consumer(kafka.settings(group_id="bench-raw", enable_auto_commit=False, isolation_level="read_committed"))
    consumer.assign([TopicPartition(topic, p, 0) for p in (0, 1)])
    seen = 0
    while seen < records:
        seen += len(consumer.consume(10000, timeout=1.0))
    consumer.close()


def timed(run: Callable[[], None]) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--per-batch", type=int, default=250_000)
    parser.add_argument("--backend", default="auto")
    args = parser.parse_args()
    n = args.records

    with start_services(args.backend).running() as services:
        kafka = KafkaConfig(services.kafka.bootstrap_servers)
        create_topic(kafka, TOPIC, partitions=2)
        results: list[tuple[str, float]] = [("raw confluent-kafka produce loop", timed(lambda: raw_produce(kafka, TOPIC, n)))]
        results.append(("raw confluent-kafka consume loop", timed(lambda: raw_consume(kafka, TOPIC, n))))
        spark = spark_session("oncekit-bench-kafka")

        def stream() -> Any:
            return kafka_stream(spark, kafka.bootstrap_servers, TOPIC, max_offsets_per_trigger=args.per_batch)

        def noop() -> None:
            with tempfile.TemporaryDirectory() as checkpoint:
                stream().writeStream.format("noop").option("checkpointLocation", checkpoint) \
                    .trigger(availableNow=True).start().awaitTermination()

        noop()  # warm-up: the session's first query pays for starting Python workers
        results.append(("oncekit source -> noop sink", timed(noop)))
        for protocol in ("at-least-once", "transactional", "write-ahead-log"):
            sink = kafka_sink(kafka.bootstrap_servers, f"bench-out-{protocol}", protocol)

            def run(sink: Any = sink) -> None:
                with tempfile.TemporaryDirectory() as checkpoint:
                    start_query(stream().select("key", "value"), sink, checkpoint,
                                trigger={"availableNow": True}).await_termination()

            results.append((f"oncekit source -> {protocol} sink", timed(run)))
        spark.stop()

    print(f"\n{n:,} records of 100 bytes, 2 partitions, {args.per_batch:,} per batch, Spark local[*]")
    print(f"| {'case':<40} | {'seconds':>8} | {'records/s':>10} |")
    print(f"|{'-' * 42}|{'-' * 10}|{'-' * 12}|")
    for name, seconds in results:
        print(f"| {name:<40} | {seconds:>8.1f} | {n / seconds:>10,.0f} |")


if __name__ == "__main__":
    main()

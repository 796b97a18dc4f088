"""oncekit's benchmarks: one harness, ``make bench`` (or ``python -m benchmarks`` from the
repository root, with the ``bench`` extra installed), that measures the kit beside its peers in
the same run, on the same broker, topics and database, one case after the other:

1. source: the kit's Kafka source vs Spark's JVM Kafka source, into the noop sink; a raw
   confluent-kafka consume loop as the ceiling.
2. kafka: the kit's transactional, write-ahead-log and at-least-once sinks vs Spark's Kafka sink,
   all fed by the kit's source; Quix Streams and Kafka Streams (exactly-once and at-least-once)
   and Flink (exactly-once) copying the same topic. Throughput groups also give the cores a case
   used and its records/s per core.
3. postgres: the kit's two-phase-commit, write-ahead-log, idempotent and at-least-once sinks vs a
   hand-written foreachBatch COPY.
4. latency: produce-to-visible p50/p99 at a fixed input rate, kit source and transactional sink
   on three triggers vs Spark's JVM source and sink, Kafka Streams exactly_once_v2 and Flink
   exactly-once with 100 ms checkpoints.
5. reference: the reference pipeline's sustained events/s (availableNow) and its produce-to-visible
   latency at a fixed rate, each run checked line by line as ``oncekit demo`` checks its report,
   beside the same pipeline as a PySpark user writes it today (``reference_peer``).
6. state: RocksDB changelog checkpointing (the kit's default) vs a state snapshot per batch
   (Spark's default): state commit time per batch and checkpoint size of a dedup query.
7. recovery: kill -9 of the driver of a Kafka -> Kafka query at a fixed input rate, ``--kills``
   times, kit transactional vs Spark's JVM source and sink: seconds from the kill to each step
   of the new driver (process, session, query, sinks recovered, first batch planned and
   committed, caught up), median and maximum.

8. fanout: one fan-out query writing every record to three targets (a topic, two tables) vs
   three queries side by side, one per target: throughput and the largest Python worker's
   resident memory.
9. partitions: seconds per batch on inputs of 2, 32 and 128 partitions, each exactly-once
   protocol against the kit's source into noop, and the kit's source against Spark's.

Every output is read back (count and distinct keys) before its figure is printed; a failed run
or check prints FAILED instead. Each table ends with ratios kit / peer.

Modules: ``environment`` (options, services, the Spark session with Spark's Kafka connector,
the inputs), ``data`` (producing input, reading outputs back), ``peers`` (the pipelines the kit
is measured against), ``jvm`` (Kafka Streams and Flink, Java programs in benchmarks/jvm/),
``usage`` (the CPU and memory a case used), ``cases`` (groups 1-3 and 8), ``latency`` (group 4), ``reference`` (group 5), ``state`` (group 6),
``recovery`` (group 7), ``partitions`` (group 9),
``table`` (rows, checks, ratios).
"""

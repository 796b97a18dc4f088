"""The exactly-once engine: sink protocols and committables, journal, Spark's logs read back,
checkpoint-complete and recovery, staging, crash points, restart strategies, savepoints, errors.

Imports neither pyspark (only ``core/spark/`` adapts the engine to Spark), nor a client library
(confluent-kafka, psycopg), nor ``oncekit.sinks`` / ``oncekit.sources``; pyarrow is its file layer.
"""

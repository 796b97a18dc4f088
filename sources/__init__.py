"""Replayable sources for Spark Structured Streaming, with offsets kept in Spark's checkpoint.
May import core and connectors and the client libraries; pyspark only in ``_spark_kafka.py``."""

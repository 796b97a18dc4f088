"""A job as its user writes it, with its own brokers, topic, table and checkpoint. ``oncekit verify
--pipeline user_job:start --input orders.jsonl`` runs it as written, against services of its own."""

from __future__ import annotations

from typing import Any

from pyspark.sql import functions as F

from oncekit import Trigger, kafka_stream, postgres_sink, start_query

ORDER = "order_id BIGINT, customer STRING, amount DECIMAL(10,2), status STRING"


def start(spark: Any) -> Any:
    orders = (kafka_stream(spark, "kafka.shop.internal:9092", "orders", max_offsets_per_trigger=5_000)
              .select(F.from_json(F.col("value").cast("string"), ORDER).alias("order"))
              .select("order.*")
              .where("status = 'paid'"))  # a malformed record parses to nulls, and is dropped here
    paid = postgres_sink("postgresql://shop@db.shop.internal/shop", "paid_orders", "two-phase-commit")
    return start_query(orders, paid, "s3a://shop-checkpoints/paid-orders",
                       trigger=Trigger(processing_time="10 seconds"))

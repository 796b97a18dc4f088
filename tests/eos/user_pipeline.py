"""A pipeline as a user hands it to ``oncekit verify --pipeline tests.eos.user_pipeline:start``:
a function of the Spark session and the harness's context that starts a streaming query."""

from __future__ import annotations

from typing import Any

from oncekit import kafka_stream, postgres_sink, start_query
from oncekit.verify import PipelineContext

kind = "postgres"  # where the harness reads the output: column id of table ctx.output


def start(spark: Any, ctx: PipelineContext) -> Any:
    events = kafka_stream(spark, ctx.bootstrap_servers, ctx.input_topic,
                          max_offsets_per_trigger=ctx.max_offsets_per_trigger)
    ids = events.selectExpr("TRY_CAST(CAST(value AS STRING) AS BIGINT) AS id", "'user' AS payload").where("id IS NOT NULL")
    return start_query(ids, postgres_sink(ctx.dsn, ctx.output, "two-phase-commit"), ctx.checkpoint, trigger=ctx.trigger)

"""A job as written under ``oncekit verify`` (oncekit.verify.as_written): which functions are
jobs, how their sinks are pointed at the harness, the tables made from a stream's schema, and
the command line's refusals."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from oncekit import fan_out, kafka_sink, postgres_sink
from oncekit.core.errors import ConfigError
from oncekit.verify import PipelineContext
from oncekit.verify.as_written import (
    JobInput,
    Target,
    Targets,
    column_type,
    install,
    job_records,
    redirect_sink,
    takes_spark_only,
)

CTX = PipelineContext("harness:9092", "verify-in", "vj_1234", "/tmp/cp", "postgresql://harness@h/db?password=s3cret",
                      kafka_client={"security.protocol": "PLAINTEXT"})


def test_a_job_takes_the_session_only() -> None:
    def job(spark: Any) -> None: ...
    def pipeline(spark: Any, ctx: Any) -> None: ...
    def job_with_defaults(spark: Any, name: str = "x") -> None: ...
    assert takes_spark_only(job) and takes_spark_only(job_with_defaults)
    assert not takes_spark_only(pipeline)


def test_sinks_are_pointed_at_the_harness_under_names_of_the_run() -> None:
    table = redirect_sink(postgres_sink("postgresql://shop@db/shop", "sales.paid", "two-phase-commit",
                                        dead_letter_table="bad"), CTX)
    assert (table.dsn, table.table, table.dead_letter_table, table.sink_id) == (  # type: ignore[attr-defined]
        CTX.dsn, "vj_1234_paid", "vj_1234_bad", "vj_1234-pg-sales.paid")
    assert "s3cret" not in repr(table)
    topic = redirect_sink(kafka_sink("prod:9092", "payments", client={"sasl.password": "p"}), CTX)
    assert (topic.bootstrap_servers, topic.topic, dict(topic.client)) == (  # type: ignore[attr-defined]
        "harness:9092", "vj_1234_payments", {"security.protocol": "PLAINTEXT"})
    both = redirect_sink(fan_out({"a": postgres_sink("postgresql://x@y/z", "t", columns=("id",)),
                                  "b": kafka_sink("prod:9092", "k")}), CTX)
    assert [t.sink_id for t in both.targets.values()] == ["vj_1234-pg-t", "vj_1234-kafka-k"]  # type: ignore[attr-defined]


def test_tables_are_made_from_the_streams_types_and_an_unmapped_one_is_named() -> None:
    assert column_type("amount", "decimal(10,2)") == "numeric(10,2)"
    assert column_type("id", "bigint") == "bigint"
    with pytest.raises(ConfigError, match="column 'tags' is array<string>"):
        column_type("tags", "array<string>")


def test_the_command_line_asks_for_a_jobs_input_and_refuses_it_for_a_pipeline_under_test(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--input FILE"):
        job_records("tests.eos.user_job:start", None)
    with pytest.raises(ConfigError, match="takes the harness's input"):
        job_records("tests.eos.user_pipeline:start", str(tmp_path / "x"))
    (tmp_path / "in.txt").write_text("a\n\nb\n")
    assert job_records("tests.eos.user_job:start", str(tmp_path / "in.txt")) == [b"a", b"b"]
    (tmp_path / "empty.txt").write_text("\n")
    with pytest.raises(ConfigError, match="no records"):
        job_records("tests.eos.user_job:start", str(tmp_path / "empty.txt"))


def test_input_is_split_into_one_chunk_per_fault() -> None:
    chunks = JobInput([str(i).encode() for i in range(7)], 3).chunks
    assert [[i for i, _ in chunk] for chunk in chunks] == [[0, 1, 2], [3, 4, 5], [6]]
    assert [len(chunk) for chunk in JobInput([b"a"], 3).chunks] == [1, 0, 0]


def test_the_jobs_source_and_query_are_redirected_and_a_restart_starts_the_same_query_again(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import oncekit.core.spark.query as query_module
    import oncekit.sources.kafka as source_module

    reads: list[tuple[Any, ...]] = []
    starts: list[tuple[Any, ...]] = []
    monkeypatch.setattr(source_module, "kafka_stream", lambda spark, servers, topics, **options: reads.append(
        (servers, topics, options)))
    monkeypatch.setattr(query_module, "start_query", lambda frame, sink, checkpoint, **keywords: starts.append(
        (sink, checkpoint, keywords)))
    ctx = PipelineContext("harness:9092", "verify-in", "vj_1234", str(tmp_path / "cp"), "",
                          kafka_client={"security.protocol": "PLAINTEXT"})
    install(ctx)

    source_module.kafka_stream(None, "prod:9092", "orders", max_offsets_per_trigger=5, starting_offsets="latest",
                               **{"kafka.sasl.password": "p", "failOnDataLoss": "false"})
    assert reads == [("harness:9092", "verify-in", {
        "connector": "oncekit", "starting_offsets": "earliest", "max_offsets_per_trigger": ctx.max_offsets_per_trigger,
        "failOnDataLoss": "false", "kafka.security.protocol": "PLAINTEXT"})]
    with pytest.raises(ConfigError, match="one input topic"):
        source_module.kafka_stream(None, "prod:9092", ["orders", "refunds"])

    frame = SimpleNamespace(schema=SimpleNamespace(fields=[]))
    for _ in range(2):  # the job, and the job started again by its restart strategy
        query_module.start_query(frame, kafka_sink("prod:9092", "paid"), "s3a://shop/cp", trigger=None)
    assert [(sink.topic, checkpoint) for sink, checkpoint, _ in starts] == [("vj_1234_paid", ctx.checkpoint)] * 2
    assert starts[0][2]["trigger"] == ctx.trigger
    assert Targets(ctx.checkpoint).read() == [Target("kafka", "paid", "vj_1234_paid")]
    with pytest.raises(ConfigError, match="starts one query"):
        query_module.start_query(frame, kafka_sink("prod:9092", "other"), "s3a://shop/other")

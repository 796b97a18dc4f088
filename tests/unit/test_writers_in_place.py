"""Behind Spark's own Kafka source, a sink that commits per task gets its rows by a hash of
their values (issue 48 item 4): what :func:`~oncekit.core.spark.query.writers_in_place` hands
``writeStream``, on stand-ins of a frame and its session (the real services' crash-point cases
are in tests/eos/test_kafka_sinks.py)."""

from __future__ import annotations

from typing import Any

import pytest
from pyspark.sql.types import ArrayType, BinaryType, IntegerType, MapType, StringType, StructField, StructType, VariantType

from oncekit.core.errors import ConfigError
from oncekit.core.fanout import fan_out
from oncekit.core.spark import query
from oncekit.sinks.kafka import kafka_sink
from oncekit.sinks.postgres import postgres_sink

KAFKA_COLUMNS = StructType([StructField("key", BinaryType()), StructField("value", BinaryType()),
                            StructField("headers", MapType(StringType(), BinaryType())),
                            StructField("target", StringType()), StructField("n", IntegerType()),
                            StructField("variant", StructType([StructField("variant", IntegerType())])),
                            StructField("tags", ArrayType(StructType([StructField("v", VariantType())])))])


class _Context:
    defaultParallelism = 3


class _Session:
    def __init__(self, connect: bool) -> None:
        self.conf = self
        self._connect = connect

    @property
    def sparkContext(self) -> _Context:
        if self._connect:
            raise AttributeError("sparkContext")  # as a Spark Connect client's session
        return _Context()

    def get(self, key: str, default: Any = None) -> Any:
        return {"spark.sql.shuffle.partitions": "7"}.get(key, default)


class _Frame:
    def __init__(self, schema: StructType = KAFKA_COLUMNS, connect: bool = False) -> None:
        self.schema = schema
        self.sparkSession = _Session(connect)
        self.repartitioned: tuple[Any, ...] | None = None

    def repartition(self, *arguments: Any) -> _Frame:
        self.repartitioned = arguments
        return self


@pytest.fixture
def spark_source(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(query, "reads_spark_kafka", lambda frame: True)


def test_a_transactional_sink_behind_spark_source_gets_its_rows_by_a_hash_of_every_hashable_column(
    spark_source: None,
) -> None:
    frame = _Frame()
    assert query.writers_in_place(frame, kafka_sink("b:1", "t", "transactional")) is frame  # type: ignore[arg-type]
    # a map, or a variant in an array: Spark cannot hash them; a field named "variant" it can
    assert frame.repartitioned == (3, "key", "value", "target", "n", "variant")


def test_from_a_spark_connect_client_the_count_is_the_shuffle_partitions(spark_source: None) -> None:
    frame = _Frame(connect=True)
    query.writers_in_place(frame, kafka_sink("b:1", "t", "transactional"))  # type: ignore[arg-type]
    assert frame.repartitioned is not None and frame.repartitioned[0] == 7


def test_a_fan_out_with_a_transactional_target_is_spread_and_one_without_is_left_alone(spark_source: None) -> None:
    spread, left = _Frame(), _Frame()
    query.writers_in_place(spread, fan_out({"a": postgres_sink("postgresql://h/d", "x"),  # type: ignore[arg-type]
                                            "b": kafka_sink("b:1", "t", "transactional")}))
    query.writers_in_place(left, fan_out({"a": postgres_sink("postgresql://h/d", "x"),  # type: ignore[arg-type]
                                          "b": kafka_sink("b:1", "t", "write-ahead-log")}))
    assert spread.repartitioned is not None and left.repartitioned is None


def test_the_kits_source_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(query, "reads_spark_kafka", lambda frame: False)
    frame = _Frame()
    query.writers_in_place(frame, kafka_sink("b:1", "t", "transactional"))  # type: ignore[arg-type]
    assert frame.repartitioned is None


def test_rows_of_map_columns_only_are_refused_naming_the_sink(spark_source: None) -> None:
    frame = _Frame(StructType([StructField("headers", MapType(StringType(), BinaryType()))]))
    with pytest.raises(ConfigError, match="sink kafka-t: .* every column is a map or variant.* write-ahead-log"):
        query.writers_in_place(frame, kafka_sink("b:1", "t", "transactional"))  # type: ignore[arg-type]

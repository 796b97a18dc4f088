from __future__ import annotations

import pytest
from confluent_kafka import KafkaError, KafkaException

from oncekit.connectors.kafka import retrying
from oncekit.core.errors import ConfigError
from oncekit.sources.kafka import KafkaSourceOptions, _resolve

BASE = {"kafka.bootstrap.servers": "b:9092", "subscribe": "a, b"}


def test_parse_defaults_to_read_committed_and_earliest() -> None:
    options = KafkaSourceOptions.parse(BASE)
    assert options.topics == ("a", "b")
    assert options.client["isolation.level"] == "read_committed"
    assert options.starting_offsets == "earliest"
    assert options.fail_on_data_loss is True


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"subscribe": "a"}, "kafka.bootstrap.servers"),
        ({"kafka.bootstrap.servers": "b:1"}, "subscribe"),
        ({**BASE, "maxOffsetsPerTrigger": "ten"}, "maxOffsetsPerTrigger"),
        ({**BASE, "maxOffsetsPerTrigger": "0"}, "positive"),
        ({**BASE, "kafka.isolation.level": "dirty"}, "isolation.level"),
    ],
)
def test_parse_bad_option_names_it(options: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        KafkaSourceOptions.parse(options)


def test_parse_repr_hides_sasl_password() -> None:
    options = KafkaSourceOptions.parse({**BASE, "kafka.sasl.password": "s3cr3t"})
    assert "s3cr3t" not in repr(options)


MARKS = {("t", 0): (5, 50), ("t", 1): (0, 7)}


def test_resolve_earliest_latest_and_json() -> None:
    assert _resolve("earliest", MARKS, "startingOffsets") == {"t": {"0": 5, "1": 0}}
    assert _resolve("latest", MARKS, "startingOffsets") == {"t": {"0": 50, "1": 7}}
    assert _resolve('{"t": {"0": 20, "1": -1}}', MARKS, "startingOffsets") == {"t": {"0": 20, "1": 7}}


def test_resolve_bad_json_is_config_error() -> None:
    with pytest.raises(ConfigError, match="startingOffsets"):
        _resolve("{nope", MARKS, "startingOffsets")


def test_parse_pattern_instead_of_topics() -> None:
    options = KafkaSourceOptions.parse({"kafka.bootstrap.servers": "b:1", "subscribePattern": "pay.*"})
    assert options.topics == () and options.topic_pattern == "pay.*"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"subscribe": "a", "subscribePattern": "a.*"}, "one of the options"),
        ({"subscribePattern": "("}, "not a regular expression"),
        ({"subscribe": "a", "startingTimestamp": "yesterday"}, "startingTimestamp"),
    ],
)
def test_parse_subscription_and_timestamp_errors(extra: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        KafkaSourceOptions.parse({"kafka.bootstrap.servers": "b:1", **extra})


def test_partitions_added_are_read_from_zero_and_fewer_are_refused() -> None:
    from oncekit.sources._spark_kafka import _ranges
    from oncekit.sources.kafka import DataLossError, check_partitions

    options = KafkaSourceOptions.parse({"kafka.bootstrap.servers": "b:9092", "subscribe": "payments"})
    start = {"payments": {"0": 5, "1": 7}}
    grown = {("payments", 0): (0, 9), ("payments", 1): (0, 7), ("payments", 2): (0, 4)}
    check_partitions(options, start, grown)
    assert [(r.partition, r.start, r.end) for r in _ranges(start, {"payments": {"0": 9, "1": 7, "2": 4}})] == [
        (0, 5, 9), (2, 0, 4)]
    with pytest.raises(DataLossError, match="topic payments has 1 partitions, the checkpoint read from partitions 1 beyond"):
        check_partitions(options, start, {("payments", 0): (0, 9)})
    lenient = KafkaSourceOptions.parse({"kafka.bootstrap.servers": "b:9092", "subscribe": "payments", "failOnDataLoss": "false"})
    check_partitions(lenient, start, {("payments", 0): (0, 9)})


def test_watermark_attempt_on_a_client_without_the_partition_yet_is_asked_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A consumer made right after a broker restart can be asked about a partition before its
    metadata holds it (_UNKNOWN_PARTITION); the soak's planner failed the query on it. The
    planner asks again, on a new client."""
    monkeypatch.setattr("oncekit.core.clock.sleep", lambda _: None)
    answers = iter([KafkaException(KafkaError(KafkaError._UNKNOWN_PARTITION)), {("t", 0): (0, 5)}])

    def attempt() -> dict[tuple[str, int], tuple[int, int]]:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert retrying("watermarks of t", attempt) == {("t", 0): (0, 5)}


def test_watermark_query_that_keeps_failing_names_what_it_asked_and_how_long() -> None:
    def attempt() -> None:
        raise KafkaException(KafkaError(KafkaError._TRANSPORT, "Failed to get metadata: Local: Broker transport failure"))

    with pytest.raises(KafkaException, match=r"watermarks of orders\[3\]: .*transport failure, still after 0 s"):
        retrying("oncekit-kafka: watermarks of orders[3]", attempt, timeout_s=0.0)


class _Reader:
    """What kafka_stream calls on ``spark.readStream``: the options kept; ``load`` as a session
    without Spark's Kafka connector answers (pure logic: no JVM)."""

    def __init__(self) -> None:
        self.given: dict[str, str] = {}
        self.source = ""

    def format(self, source: str) -> _Reader:
        self.source = source
        return self

    def option(self, key: str, value: str) -> _Reader:
        self.given[key] = value
        return self

    def options(self, **more: str) -> _Reader:
        self.given.update(more)
        return self

    def load(self) -> None:
        raise RuntimeError("[DATA_SOURCE_NOT_FOUND] Failed to find the data source: kafka.")


class _Session:
    version = "4.3.0"

    def __init__(self) -> None:
        self.readStream = _Reader()


def test_spark_connector_missing_names_the_package_and_the_other_connector() -> None:
    from oncekit.sources.kafka import kafka_stream

    session = _Session()
    with pytest.raises(ConfigError, match=r"--packages org\.apache\.spark:spark-sql-kafka-0-10_2\.13:4\.3\.0 .*"
                                          r"connector='oncekit'"):
        kafka_stream(session, "b:9092", "payments", connector="spark")  # type: ignore[arg-type]
    assert session.readStream.source == "kafka"
    assert session.readStream.given["kafka.isolation.level"] == "read_committed"


def test_unknown_connector_is_refused() -> None:
    from oncekit.sources.kafka import kafka_stream

    with pytest.raises(ConfigError, match="connector 'jvm' is not one of oncekit, spark"):
        kafka_stream(_Session(), "b:9092", "payments", connector="jvm")  # type: ignore[arg-type]


def test_a_topic_pattern_reaches_the_source_and_topics_with_a_pattern_are_refused() -> None:
    from oncekit.sources.kafka import kafka_stream

    session = _Session()
    with pytest.raises(ConfigError, match="DATA_SOURCE_NOT_FOUND|--packages"):
        kafka_stream(session, "b:9092", connector="spark", subscribePattern="orders-.*")  # type: ignore[arg-type]
    assert session.readStream.given["subscribePattern"] == "orders-.*" and "subscribe" not in session.readStream.given
    for topics, options in ((None, {}), ("orders", {"subscribePattern": "orders-.*"})):
        with pytest.raises(ConfigError, match="give the topics, or subscribePattern"):
            kafka_stream(_Session(), "b:9092", topics, **options)  # type: ignore[arg-type]


def test_assign_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="option assign .* not supported"):
        KafkaSourceOptions.parse({**BASE, "assign": '{"a": [0]}'})


@pytest.mark.parametrize(("setting", "instead"), [
    ("sasl.jaas.config", "sasl.username and sasl.password"),
    ("ssl.truststore.location", "ssl.ca.location"),
    ("ssl.keystore.type", "PKCS#12"),
    ("value.deserializer", "string or binary column"),
])
def test_a_java_client_setting_is_refused_naming_librdkafkas_equivalent_and_no_secret(setting: str, instead: str) -> None:
    from oncekit.connectors import KafkaConfig
    from oncekit.sinks.kafka import kafka_sink

    secret = 'org.apache.kafka.common.security.plain.PlainLoginModule required username="u" password="s3cr3t";'
    with pytest.raises(ConfigError) as source:
        KafkaSourceOptions.parse({**BASE, f"kafka.{setting}": secret})
    with pytest.raises(ConfigError) as sink:
        kafka_sink("b:9092", "out", client={setting: secret})
    with pytest.raises(ConfigError) as config:
        KafkaConfig("b:9092", {setting: secret})
    for raised, spelled in ((source, f"kafka.{setting}"), (sink, setting), (config, setting)):
        text = str(raised.value)
        assert spelled in text and instead in text and "s3cr3t" not in text, text


def test_max_partitions_groups_ranges_the_same_way_for_the_same_offsets() -> None:
    """A batch's tasks with maxPartitions: at most that many, the larger ranges spread first, each
    task reading its ranges in topic-partition order; the same offsets group the same way (a
    replay's task of an index reads what its first run's did)."""
    from oncekit.sources._reader import KafkaRange
    from oncekit.sources._spark_kafka import _ranges, _tasks

    end = {"b": {str(p): 10 * (p + 1) for p in range(5)}, "a": {"0": 35}}
    ranges = _ranges({}, end)
    grouped = _tasks(ranges, 3)
    assert [[(r.topic, r.partition) for r in task.ranges] for task in grouped] == [
        [("b", 0), ("b", 4)], [("b", 1), ("b", 3)], [("a", 0), ("b", 2)]]
    assert [sum(r.end - r.start for r in task.ranges) for task in grouped] == [60, 60, 65]
    assert [t.ranges for t in _tasks(list(reversed(ranges)), 3)] == [t.ranges for t in grouped]
    assert [t.ranges for t in _tasks(ranges, None)] == [(r,) for r in ranges] == [t.ranges for t in _tasks(ranges, 6)]
    assert repr(_tasks([KafkaRange("a", 1, 2, 3)], 1)[0]) == "KafkaTask(a-1 [2, 3))"


@pytest.mark.parametrize("given", ["0", "-1", "two", ""])
def test_max_partitions_must_be_a_positive_whole_number(given: str) -> None:
    with pytest.raises(ConfigError, match="maxPartitions must be a positive whole number"):
        KafkaSourceOptions.parse({"kafka.bootstrap.servers": "b:1", "subscribe": "t", "maxPartitions": given})
    assert KafkaSourceOptions.parse({"kafka.bootstrap.servers": "b:1", "subscribe": "t", "maxpartitions": "4"}).max_partitions == 4

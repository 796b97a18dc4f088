"""The plan fingerprint keeps what shapes a replay (operators, partition counts, the options that
split a source's ranges, the settings that split files) and drops what differs between two
analyzations of one plan or leaves a replay's partitioning alone (issue 21 item 5, issue 36
finding 4)."""

from __future__ import annotations

import pytest

from oncekit.core.spark.plan import Plan, earlier_normalized, normalized, replay_refusal

PLAN = ("Project [concat(cast(id#{a}L as string), :, uuid(Some({seed}))) AS v#{b}, randn(5) AS n#{c}]\n"
        "+- Repartition {n}, true\n"
        "  +- EventTimeWatermark {node}, kafka_ts#{c}: timestamp, 1 hours\n"
        "   +- StreamingRelationV2 org.apache...PythonDataSourceV2@{obj}, oncekit-kafka, [subscribe=t1], "
        "[key#{a}, value#{b}], splits=Some(1)")


def test_two_analyzations_of_one_plan_are_equal() -> None:
    first = PLAN.format(a=0, b=1, c=2, seed=-6076580165851620920, n=4, obj="17f325e",
                        node="46413dd7-7ae3-4374-8ba9-47b78cc642ea")
    second = PLAN.format(a=31, b=32, c=33, seed=5914162375528373497, n=4, obj="3c857b87",
                         node="a0aa1953-78a4-4caf-a887-53ebb685156a")
    assert normalized(first) == normalized(second)


def test_another_partition_count_differs() -> None:
    four = PLAN.format(a=0, b=1, c=2, seed=1234567890123, n=4, obj="17f325e", node="46413dd7-7ae3-4374-8ba9-47b78cc642ea")
    two = PLAN.format(a=0, b=1, c=2, seed=1234567890123, n=2, obj="17f325e", node="46413dd7-7ae3-4374-8ba9-47b78cc642ea")
    assert normalized(four) != normalized(two)


def test_a_source_option_that_leaves_the_replay_alone_is_no_change() -> None:
    """A replay reads the offset log's ranges: servers, starting offsets or a client id made at
    each start (a timestamp in it) do not move a row to another partition."""
    first = PLAN.format(a=0, b=1, c=2, seed=1, n=4, obj="1", node="x").replace(
        "[subscribe=t1]", "[startingOffsets=earliest, kafka.client.id=job-1795770000, subscribe=t1, maxOffsetsPerTrigger=5]")
    second = first.replace("job-1795770000", "job-1795770099").replace("maxOffsetsPerTrigger=5", "maxOffsetsPerTrigger=9")
    assert normalized(first) == normalized(second)
    split = first.replace("subscribe=t1,", "subscribe=t1, minPartitions=8,")  # Spark's Kafka source splits ranges by it
    assert normalized(split) != normalized(first)


def test_a_changed_file_split_setting_is_refused_naming_it_and_the_value_to_start_with() -> None:
    before = Plan("abc", {"spark.sql.files.maxPartitionBytes": "134217728", "spark.sql.leafNodeDefaultParallelism": "8"})
    now = Plan("abc", {"spark.sql.files.maxPartitionBytes": "134217728", "spark.sql.leafNodeDefaultParallelism": "2"})
    refusal = replay_refusal("s", 7, "/cp", before, now)
    assert refusal is not None
    assert "sink s batch 7" in refusal and "spark.sql.leafNodeDefaultParallelism was 8" in refusal and "is 2" in refusal
    assert "spark.sql.leafNodeDefaultParallelism=8" in refusal  # the way out: start with the recorded value
    assert replay_refusal("s", 7, "/cp", before, before) is None
    assert "plan changed" in (replay_refusal("s", 7, "/cp", before, Plan("def", before.settings)) or "")


def test_a_record_written_before_settings_were_kept_still_reads(tmp_path: pytest.TempPathFactory) -> None:
    assert Plan.from_bytes(b"0123abcd") == Plan("0123abcd", {})
    plan = Plan("abc", {"spark.sql.files.maxPartitionBytes": None})
    assert Plan.from_bytes(plan.to_bytes()) == plan


def test_a_record_of_the_earlier_fingerprint_is_no_change_of_the_same_plan() -> None:
    """A checkpoint whose record an earlier version wrote (the plan's whole text, options and all,
    hashed) and whose batch was cut short by the upgrade: the same plan started by this version
    replays it, it is not refused."""
    import hashlib

    text = PLAN.format(a=0, b=1, c=2, seed=1, n=4, obj="1", node="x")
    earlier = Plan.from_bytes(hashlib.sha256(earlier_normalized(text).encode()).hexdigest().encode())
    now = Plan(hashlib.sha256(normalized(text).encode()).hexdigest(), {},
               earlier=hashlib.sha256(earlier_normalized(text).encode()).hexdigest())
    assert replay_refusal("s", 1, "/cp", earlier, now) is None
    other = Plan("0" * 64, {}, earlier="1" * 64)
    assert replay_refusal("s", 1, "/cp", earlier, other) is not None

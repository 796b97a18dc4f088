"""The plan fingerprint keeps what shapes a replay (operators, partition counts, options) and
drops what differs between two analyzations of one plan (issue 21 item 5)."""

from __future__ import annotations

from oncekit.core.spark.plan import normalized

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

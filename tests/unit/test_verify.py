from __future__ import annotations

import dataclasses

import pytest

from oncekit.core.errors import ConfigError
from oncekit.verify import CampaignReport, Fault, FaultResult, PipelineContext, compare, resolve, schedule, table


def test_compare_same_multiset_is_exactly_once() -> None:
    assert compare([1, 2, 2, 3], [3, 2, 1, 2]).exactly_once


def test_compare_catches_loss_and_duplicate_with_equal_counts() -> None:
    verdict = compare([1, 2, 3], [1, 1, 3])
    assert not verdict.exactly_once
    assert verdict.lost == {2: 1} and verdict.duplicated == {1: 1}
    assert "lost 1" in verdict.summary()


def test_compare_duplicates_only_is_at_least_once() -> None:
    verdict = compare([1, 2], [1, 2, 2])
    assert verdict.at_least_once and not verdict.exactly_once


def test_compare_unexpected_record_is_not_exactly_once() -> None:
    verdict = compare([1], [1, 9])
    assert verdict.unexpected == {9: 1} and not verdict.exactly_once


def test_verdict_names_loss_and_duplicates_together() -> None:
    assert compare([1, 2], [1, 1]).name == "LOSS+DUPLICATES"
    assert compare([1, 2], [1]).name == "LOSS" and compare([1, 2], [1]).holds("at-most-once")
    assert compare([1], [1, 1]).holds("at-least-once") and not compare([1], [1, 1]).holds("at-most-once")


def _report(guarantee: str, *verdicts: str, left: tuple[str, ...] = ()) -> CampaignReport:
    results = [FaultResult(str(Fault("crash", "mid_commit")), True, 3, 1, 0, 2.5, v, "") for v in verdicts]
    return CampaignReport("postgres-two-phase-commit", 7, guarantee, results, verdicts[-1], list(left), "")


def test_report_passes_only_when_every_verdict_meets_the_guarantee() -> None:
    assert _report("exactly-once", "exactly-once", "exactly-once").passed
    assert not _report("exactly-once", "exactly-once", "duplicates").passed
    assert _report("at-least-once", "exactly-once", "duplicates").passed
    assert not _report("exactly-once", "exactly-once", left=("prepared transaction x",)).passed


def test_table_names_fault_batch_recovery_and_verdict() -> None:
    text = table(_report("exactly-once", "exactly-once"))
    assert "seed 7" in text and "crash mid_commit" in text and "exactly-once" in text and "2.5" in text
    assert "longest recovery 2.5 s" in text


def test_stalled_fault_fails_the_report_and_the_table_names_it() -> None:
    report = _report("exactly-once", "exactly-once", "exactly-once")
    report.results[1] = dataclasses.replace(report.results[1], stalled=True)
    assert not report.passed  # exactly-once, but not live
    assert "STALLED (not caught up within the catch-up window; the driver was killed and restarted" in table(report)
    assert "exactly-once, STALL" in table(report).splitlines()[4]
    assert "fault 1" in table(report).splitlines()[-2]
    assert "STALL" not in table(_report("exactly-once", "exactly-once"))


def test_fault_descriptions() -> None:
    assert str(Fault("crash", "task_after_pre_commit")) == "crash task_after_pre_commit (task retried by Spark)"
    assert str(Fault("kill", delay_s=1.25)) == "kill -9 driver after 1.2 s"
    assert str(Fault("postgres-cut", outage_s=5)) == "postgres cut off network 5 s"
    assert str(Fault("kafka-restart", outage_s=3)) == "kafka stopped 3 s"


def test_schedule_uses_only_the_points_a_sink_reaches() -> None:
    faults = schedule(3, 60, points=("task_before_write",), network_cuts=False)
    assert {f.point for f in faults if f.kind == "crash"} == {"task_before_write"}
    assert {f.kind for f in faults} <= {"crash", "kill", "kafka-restart", "postgres-restart", "kafka-kill", "postgres-kill"}


def test_service_faults_only_schedule_hits_only_the_services_the_pipeline_uses() -> None:
    faults = schedule(3, 40, services_only=True, postgres=False)
    assert {f.kind for f in faults} == {"kafka-restart", "kafka-kill", "kafka-cut"}
    assert str(Fault("postgres-kill", outage_s=2)) == "postgres killed -9 2 s"


def test_unknown_pipeline_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="module:function"):
        resolve("no-such-pipeline")
    with pytest.raises(ConfigError, match="cannot load"):
        resolve("oncekit.no_such_module:start")


def test_pipeline_context_repr_hides_the_dsn() -> None:
    ctx = PipelineContext("127.0.0.1:9092", "in", "out", "/tmp/cp", dsn="postgresql://u:secret@h/db")
    assert "secret" not in repr(ctx)


def test_schedule_draws_postgres_steps_only_for_sinks_that_reach_them() -> None:
    from oncekit.verify.faults import POSTGRES_FAULTS, postgres_steps

    assert not any(f.kind in POSTGRES_FAULTS for f in schedule(3, 60))
    assert postgres_steps("kafka", "transactional") == ()
    assert postgres_steps("postgres", "idempotent") == ("postgres-terminate", "postgres-restart-batch")
    assert postgres_steps("postgres", None) == ("postgres-terminate", "postgres-restart-batch")
    assert set(postgres_steps("fan-out", "two-phase-commit+transactional")) == set(POSTGRES_FAULTS)
    drawn = schedule(3, 200, postgres_steps=postgres_steps("postgres", "two-phase-commit"))
    assert {f.kind for f in drawn if f.kind in POSTGRES_FAULTS} == set(POSTGRES_FAULTS)
    assert str(Fault("postgres-kill-prepare", outage_s=2)) == "postgres kill -9 in PREPARE TRANSACTION 2 s"


def test_soak_periodic_faults_parse_and_refuse_what_is_not_a_service_fault() -> None:
    from oncekit.verify.soak import periodic_faults

    assert periodic_faults("kafka-restart=120, postgres-restart=300") == [
        (120.0, Fault("kafka-restart", outage_s=3.0)), (300.0, Fault("postgres-restart", outage_s=3.0))]
    with pytest.raises(ConfigError, match="kind must be one of"):
        periodic_faults("kill=60")
    with pytest.raises(ConfigError, match="kind=seconds"):
        periodic_faults("kafka-restart=often")

"""The reference pipeline on real Kafka, PostgreSQL and Spark: ``oncekit demo`` as a new user
runs it (crash, automatic restart, report), savepoints that continue exactly once, a restore
the pipeline refuses, and a savepoint taken while input flows restored with twice the state
partitions and one more Kafka partition."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from oncekit.connectors import KafkaConfig, Services
from oncekit.core.savepoint import SavepointError, list_savepoints
from oncekit.core.spark_log import SparkLog
from oncekit.reference import config as pipeline_config
from oncekit.reference.config import PipelineConfig
from oncekit.reference.demo import check, expected
from oncekit.reference.generator import Workload, produce
from oncekit.reference.outputs import observe
from oncekit.reference.pipeline import ReferencePipeline

pytestmark = [pytest.mark.services, pytest.mark.spark]


def config_for(services: Services, name: str, path: Path | None = None, **overrides: Any) -> PipelineConfig:
    """The packaged config with topics and tables of this test's own."""
    names = {
        "topics.payments": f"{name}-payments".replace("_", "-"),
        "topics.balance_updates": f"{name}-balance-updates".replace("_", "-"),
        "tables.balances": f"{name}_balances", "tables.minute_totals": f"{name}_minutes",
        "tables.late_events": f"{name}_late", "tables.dead_letters": f"{name}_dead",
    }
    if path is not None:  # the same as a file, for the console script
        sections: dict[str, dict[str, Any]] = {}
        for dotted, value in {**names, **overrides}.items():
            section, key = dotted.split(".")
            sections.setdefault(section, {})[key] = value
        path.write_text("\n".join(f"[{s}]\n" + "\n".join(f"{k} = {v!r}" for k, v in kv.items()) for s, kv in sections.items())
                        .replace("'", '"'))
    loaded = pipeline_config.load(None, {**names, **overrides})
    return loaded.with_services(services.kafka.bootstrap_servers, services.postgres.dsn)


@pytest.mark.long(80)
def test_oncekit_demo_console_script_crashes_restarts_and_reports_exactly_once(
    services: Services, unique_name: str, tmp_path: Path,
) -> None:
    """As a new user would: the console script, against running services, with a config file.
    The report must pass, and the invariants are checked again here from PostgreSQL and a
    read_committed consumer."""
    config_file = tmp_path / "pipeline.toml"
    config = config_for(services, unique_name, config_file)
    script = Path(sys.executable).with_name("oncekit")
    env = {**os.environ, "ONCEKIT_KAFKA_BOOTSTRAP": services.kafka.bootstrap_servers,
           "ONCEKIT_POSTGRES_DSN": services.postgres.dsn}
    env.pop("ONCEKIT_CRASH_DIR", None)  # the demo brings its own
    done = subprocess.run([str(script), "demo", "--backend", "external", "--records", "3000", "--seed", "11",
                           "--config", str(config_file)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "exactly-once: OK" in done.stdout
    assert "pipeline failed" in done.stdout and "restart 1 from the checkpoints" in done.stdout
    assert "events/s" in done.stdout
    assert services.postgres.dsn not in done.stdout + done.stderr

    workload = Workload(count=3000, accounts=50, duplicates=0.01, late=0.02, malformed=0.005, seed=11)
    want = expected(workload, config.pipeline.allowed_lateness_s)
    got = observe(config)
    assert sum(b for b, _ in got.balances.values()) == want.amount
    assert got.balances == want.balances  # zero duplicates, zero losses, per account
    assert got.totals == want.totals
    assert sorted(got.late) == sorted(want.late) and want.late
    assert got.dead_letters == want.malformed > 0
    assert got.prepared == 0
    report = check(want, got, restarts=1, seconds=1.0)
    assert report.ok, report.text()


def run_once(spark: Any, pipeline: ReferencePipeline) -> None:
    pipeline.run(spark, poll_s=0.2)


def test_on_spark_kafka_source_a_task_crash_and_restart_report_exactly_once(
    spark: Any, services: Services, kafka: KafkaConfig, unique_name: str, tmp_path: Path, crash_dir: Path,
) -> None:
    """``pipeline.source = "spark"``: Spark's own Kafka source reads the payments, and the balance
    updates go out by Kafka transactions; a task dies after pre-committing batch 1, the query
    fails, and a restart from the checkpoint, whose batch 1 Spark plans again, ends in a report
    that is OK."""
    from oncekit.core.crash import arm, fired
    from oncekit.core.errors import PipelineError
    from oncekit.reference.demo import CRASH_BATCH, CRASH_POINT
    from tests.eos.pipeline import read_by

    config = config_for(services, unique_name, **{"pipeline.max_offsets_per_trigger": 700, "pipeline.source": "spark"})
    workload = Workload(count=2000, accounts=50, duplicates=0.01, late=0.02, malformed=0.005, seed=12)
    pipeline = ReferencePipeline(config, str(tmp_path / "checkpoint"))
    pipeline.prepare()
    produce(kafka, config.topics.payments, workload)
    arm(crash_dir, CRASH_POINT, CRASH_BATCH)
    with pytest.raises(PipelineError):
        run_once(spark, pipeline)
    assert fired(crash_dir) == [CRASH_POINT]
    run_once(spark, pipeline)
    assert read_by(pipeline.active[0]) == "spark"
    report = check(expected(workload, config.pipeline.allowed_lateness_s), observe(config), restarts=1, seconds=1.0)
    assert report.ok, report.text()


def test_savepoint_create_then_restore_continues_exactly_once_and_mismatch_is_refused(
    spark: Any, services: Services, kafka: KafkaConfig, unique_name: str, tmp_path: Path,
) -> None:
    config = config_for(services, unique_name, **{"pipeline.max_offsets_per_trigger": 1000})
    first, second = (Workload(count=1000, accounts=20, late=0.05, seed=s) for s in (21, 22))
    original = ReferencePipeline(config, str(tmp_path / "original"))
    original.prepare()
    produce(kafka, config.topics.payments, first)
    run_once(spark, original)

    saved = original.savepoint(spark, str(tmp_path / "savepoints"), "after-first")
    assert [s.name for s in list_savepoints(tmp_path / "savepoints")] == ["after-first"]
    assert {q.name: q.sink_id for q in saved.queries} == {"pipeline": original.sink().sink_id}
    assert original.sink().targets["balances"].sink_id == f"pg-{config.tables.balances}"
    assert all(q.batch_id is not None for q in saved.queries)

    changed = pipeline_config.load(None, {**_names(config), "pipeline.allowed_lateness_s": 120}).with_services(
        config.kafka_bootstrap(), config.postgres_dsn())
    with pytest.raises(SavepointError, match="operators, sink or output schema changed"):
        ReferencePipeline(changed, str(tmp_path / "refused")).restore(spark, saved.path)
    assert not (tmp_path / "refused").exists()

    produce(kafka, config.topics.payments, second)
    restored = ReferencePipeline(config, str(tmp_path / "restored"))
    restored.restore(spark, saved.path)
    with pytest.raises(SavepointError, match="not empty"):
        restored.restore(spark, saved.path)
    run_once(spark, restored)

    want = expected([first, second], config.pipeline.allowed_lateness_s)
    report = check(want, observe(config), restarts=0, seconds=1.0, crashed=False)
    assert report.ok, report.text()


def _names(config: PipelineConfig) -> dict[str, Any]:
    return {"topics.payments": config.topics.payments, "topics.balance_updates": config.topics.balance_updates,
            "tables.balances": config.tables.balances, "tables.minute_totals": config.tables.minute_totals,
            "tables.late_events": config.tables.late_events, "tables.dead_letters": config.tables.dead_letters,
            "pipeline.max_offsets_per_trigger": config.pipeline.max_offsets_per_trigger}


def test_savepoint_while_input_flows_restored_with_4_state_partitions_and_a_new_kafka_partition(
    spark: Any, services: Services, kafka: KafkaConfig, unique_name: str, tmp_path: Path,
) -> None:
    """The story of a growing job: run with 2 state partitions on a 1 s trigger, take a
    savepoint while payments are being produced, add a partition to the payments topic, restore
    with 4 state partitions (Spark repartitions the dropDuplicatesWithinWatermark and
    applyInPandasWithState state), continue; payments after the restore land in the new
    partition too and are read from its offset 0. The report is exactly once and no prepared
    transaction is left. Later payments are produced once the restored pipeline has drained the
    earlier ones, so each account's payments keep their order (its partition changes when the
    topic grows) and the expected late events stay the generator's."""
    from confluent_kafka.admin import AdminClient, NewPartitions

    config = config_for(services, unique_name, **{"pipeline.max_offsets_per_trigger": 1000, "pipeline.trigger_s": 1.0})
    first, flowing, after = (Workload(count=n, accounts=20, late=0.05, seed=s) for n, s in ((400, 31), (600, 32), (400, 33)))
    original = ReferencePipeline(config, str(tmp_path / "original"))
    original.prepare()
    produce(kafka, config.topics.payments, first)
    log = SparkLog(f"{original.checkpoint}/pipeline")
    previous = spark.conf.get("spark.sql.shuffle.partitions")
    spark.conf.set("spark.sql.shuffle.partitions", "2")  # the state partitions of a new query
    producer = threading.Thread(target=produce, args=(kafka, config.topics.payments, flowing, 50.0))
    flow: dict[str, float] = {}

    def stop_while_flowing() -> bool:
        """Start producing once the first batch has committed; ask for the stop 2 s later."""
        if log.latest_completed() is None:
            return False
        if "started" not in flow:
            producer.start()
            flow["started"] = time.monotonic()
        if time.monotonic() - flow["started"] < 2:
            return False
        flow["flowing when asked"] = float(producer.is_alive())
        return True

    try:
        original.run(spark, should_stop=stop_while_flowing, poll_s=0.2)
        saved = original.savepoint(spark, str(tmp_path / "savepoints"), "growing")
    finally:
        spark.conf.set("spark.sql.shuffle.partitions", previous)
    producer.join()
    assert flow["flowing when asked"], "the stop was asked for after the producer had finished"
    assert [q.state_partitions for q in saved.queries] == [2]

    admin = AdminClient(kafka.settings())
    admin.create_partitions([NewPartitions(config.topics.payments, 3)])[config.topics.payments].result(timeout=60)

    drain = pipeline_config.load(None, {**_names(config), "pipeline.trigger_s": 0.0}).with_services(
        config.kafka_bootstrap(), config.postgres_dsn())
    restored = ReferencePipeline(drain, str(tmp_path / "restored"))
    restored.restore(spark, saved.path, state_partitions=4)
    restored_log = SparkLog(f"{restored.checkpoint}/pipeline")
    assert restored_log.state_partitions() == 4
    run_once(spark, restored)
    produce(kafka, config.topics.payments, after)
    run_once(spark, restored)

    assert restored_log.state_partitions() == 4
    (offsets,) = restored_log.source_offsets(restored_log.latest_completed() or 0)
    assert offsets[config.topics.payments]["2"] > 0  # the new partition, read from its start
    want = expected([first, flowing, after], config.pipeline.allowed_lateness_s)
    got = observe(config)
    assert got.prepared == 0
    report = check(want, got, restarts=0, seconds=1.0, crashed=False)
    assert report.ok, report.text()

"""Crashes of the user's driver process itself, where the checkpoint-complete listener runs:
the process dies after Spark logged the last batch as committed, before (or while) its output
is committed. The restarted query must commit it, once."""

from __future__ import annotations

from pathlib import Path

import pytest

from oncekit.connectors import KafkaConfig, Services
from oncekit.core.crash import CRASH_EXIT_CODE, arm, fired
from oncekit.verify import (
    COUNT,
    PipelineContext,
    committed_output,
    compare,
    prepare_target,
    prepared_transactions,
    produce_input,
    start_driver,
)

pytestmark = [pytest.mark.services, pytest.mark.spark]

LAST_BATCH = 3


# before_notify and mid_commit of every exactly-once sink also come up in the randomized
# campaigns (tests/eos/test_verify_campaign.py); this pins the write-ahead log's on the last batch.
@pytest.mark.long(65)
@pytest.mark.parametrize(("sink", "point"), [("postgres-write-ahead-log", "mid_commit")])
def test_driver_process_dies_before_last_commit_restart_commits_it_once(
    services: Services, kafka: KafkaConfig, topic: str, unique_name: str, tmp_path: Path, crash_dir: Path,
    sink: str, point: str,
) -> None:
    expected = produce_input(kafka, topic, COUNT)
    target = unique_name if sink.startswith("postgres") else f"{topic}-out"
    prepare_target(sink, kafka, services.postgres.dsn, target)
    arm(crash_dir, point, batch_id=LAST_BATCH)
    ctx = PipelineContext(services.kafka.bootstrap_servers, topic, target, str(tmp_path / "checkpoint"), services.postgres.dsn)

    def run() -> int:
        return start_driver(sink, ctx, str(crash_dir), drain=True).wait(timeout=600)

    assert run() == CRASH_EXIT_CODE  # the driver process itself died, not just the query
    assert fired(crash_dir) == [point]
    assert run() == 0

    verdict = compare(expected, committed_output(sink, kafka, services.postgres.dsn, target, COUNT))
    assert verdict.exactly_once, verdict.summary()
    assert prepared_transactions(services.postgres.dsn, target) == []

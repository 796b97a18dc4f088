"""The pipeline's [restart] table decides whether a failed run is restarted or given up."""

from __future__ import annotations

from typing import Any

import pytest

from oncekit.reference import config
from oncekit.core.restart import RestartsExhaustedError
from oncekit.reference.pipeline import PipelineError, ReferencePipeline


class FailingPipeline(ReferencePipeline):
    """Fails its first ``failures`` runs as a crashed query would."""

    def __init__(self, restart: dict[str, Any], failures: int) -> None:
        services = config.ServicesConfig(kafka_bootstrap="k:9092", postgres_dsn="postgresql://u:p@h/d")
        super().__init__(config.PipelineConfig(services=services, restart=restart))
        self.failures, self.runs = failures, 0

    def run(self, spark: Any, tick: Any = None, should_stop: Any = None, poll_s: float = 0.5) -> None:
        self.runs += 1
        if self.runs <= self.failures:
            raise PipelineError(f"query balances failed: crash {self.runs}")


@pytest.mark.parametrize(("restart", "failures", "runs"), [
    ({"type": "fixed-delay", "attempts": 2, "delay_s": 0}, 2, 3),
    ({"type": "exponential-backoff", "initial_s": 0, "attempts": 3}, 1, 2),
    ({"type": "failure-rate", "max_failures": 5, "interval_s": 60, "delay_s": 0}, 4, 5),
])
def test_pipeline_restart_strategy_continues_within_its_limits(restart: dict[str, Any], failures: int, runs: int) -> None:
    pipeline = FailingPipeline(restart, failures)
    assert pipeline.run_supervised(lambda: None) == failures
    assert pipeline.runs == runs


@pytest.mark.parametrize(("restart", "runs"), [
    ({"type": "none"}, 1),
    ({"type": "fixed-delay", "attempts": 2, "delay_s": 0}, 3),
    ({"type": "failure-rate", "max_failures": 2, "interval_s": 60, "delay_s": 0}, 3),
])
def test_pipeline_restart_strategy_gives_up_with_a_clear_error(restart: dict[str, Any], runs: int) -> None:
    pipeline = FailingPipeline(restart, failures=10)
    with pytest.raises(RestartsExhaustedError, match="gave up after .* restarts: query balances failed") as failure:
        pipeline.run_supervised(lambda: None)
    assert isinstance(failure.value.__cause__, PipelineError)
    assert pipeline.runs == runs

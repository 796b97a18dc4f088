"""The fault campaign behind ``oncekit verify``: seeded crash points and driver kills, restarts,
multiset verdicts; and the checker catching an at-least-once sink's duplicates."""

from __future__ import annotations

import pytest

from oncekit.connectors import Services
from oncekit.verify import Fault, run_campaign, run_fault, schedule, table

pytestmark = [pytest.mark.services, pytest.mark.spark]


def test_schedule_is_reproducible_from_seed() -> None:
    assert schedule(11, 8) == schedule(11, 8)
    assert schedule(11, 8) != schedule(12, 8)


def test_campaign_two_phase_commit_every_fault_exactly_once(services: Services) -> None:
    results = run_campaign("postgres-two-phase-commit", services, faults=4, seed=2026)
    print("\n" + table("postgres-two-phase-commit", 2026, results))
    assert [r.verdict for r in results] == ["exactly-once"] * 4, table("postgres-two-phase-commit", 2026, results)


def test_campaign_catches_at_least_once_duplicates(services: Services) -> None:
    result = run_fault("postgres-at-least-once", services, Fault("crash", "task_after_pre_commit", 1), "alo-dup")
    assert result.fired and result.verdict == "duplicates", result

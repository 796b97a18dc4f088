from __future__ import annotations

import json

import pytest

from oncekit.core.errors import ConfigError
from oncekit.reference.generator import Workload, events


def test_events_reproducible_from_seed() -> None:
    assert list(events(Workload(count=500, seed=3))) == list(events(Workload(count=500, seed=3)))
    assert list(events(Workload(count=500, seed=3))) != list(events(Workload(count=500, seed=4)))


def test_events_carry_duplicates_late_and_malformed_at_their_rates() -> None:
    generated = list(events(Workload(count=20_000, duplicates=0.05, late=0.05, malformed=0.02, seed=9)))
    unique = [json.loads(e.value) for e in generated if e.unique]
    repeated = [e for e in generated if not e.unique and e.key != b"malformed"]
    malformed = [e for e in generated if e.key == b"malformed"]
    assert len({u["event_id"] for u in unique}) == len(unique)
    assert 0.03 < len(repeated) / 20_000 < 0.07 and 0.01 < len(malformed) / 20_000 < 0.03
    newest, late = "", 0
    for u in unique:  # an event an hour behind the newest one seen is late
        late += u["event_time"] < newest and newest >= "2026-01-01T02:00" and u["event_time"] < "2026-01-01T05:00"
        newest = max(newest, u["event_time"])
    assert late > 0
    assert all(set(u) == {"event_id", "account_id", "amount_cents", "event_time"} for u in unique)


def test_workload_rates_are_fractions() -> None:
    with pytest.raises(ConfigError, match="duplicates"):
        Workload(duplicates=2)

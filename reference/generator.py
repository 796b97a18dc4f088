"""Payment events for the reference pipeline (``oncekit produce``), reproducible from a seed.

Each event is JSON: ``event_id``, ``account_id``, ``amount_cents``, ``event_time`` (ISO 8601,
UTC). Upstream faults are part of the workload, as real producers make them: the same event sent
twice (a producer retry), events that arrive late (event time far behind), and malformed records.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING

from oncekit.core.errors import ConfigError

if TYPE_CHECKING:
    from oncekit.connectors import KafkaConfig

EPOCH = datetime(2026, 1, 1, tzinfo=timezone.utc)


@dataclass(frozen=True)
class Workload:
    """What to generate. Rates are fractions of the events (0 to 1)."""

    count: int = 10_000
    accounts: int = 100
    duplicates: float = 0.01
    late: float = 0.01
    malformed: float = 0.005
    late_by_s: int = 3600
    seed: int = 1

    def __post_init__(self) -> None:
        for name in ("duplicates", "late", "malformed"):
            if not 0 <= getattr(self, name) <= 1:
                raise ConfigError(f"workload: {name} is a fraction between 0 and 1, got {getattr(self, name)}")
        if self.count < 0 or self.accounts < 1:
            raise ConfigError("workload: count must be >= 0 and accounts >= 1")


@dataclass(frozen=True)
class Event:
    """One record to send; ``unique`` is False for an upstream duplicate or a malformed record."""

    key: bytes
    value: bytes
    unique: bool


def events(workload: Workload) -> Iterator[Event]:
    """The workload's records in sending order; the same seed gives the same records."""
    rng = random.Random(workload.seed)
    for index in range(workload.count):
        if rng.random() < workload.malformed:
            yield Event(b"malformed", rng.choice([b"{not json", b'{"event_id": 1}', b'{"event_id": "x", "amount_cents": "ten"}']), False)
            continue
        second = index - (workload.late_by_s if rng.random() < workload.late else 0)
        account = rng.randrange(workload.accounts)
        payload = {
            "event_id": f"{workload.seed}-{index}",
            "account_id": account,
            "amount_cents": rng.randrange(-50_000, 100_000),
            "event_time": (EPOCH + timedelta(seconds=max(0, second))).isoformat(),
        }
        event = Event(str(account).encode(), json.dumps(payload).encode(), True)
        yield event
        if rng.random() < workload.duplicates:
            yield Event(event.key, event.value, False)


def produce(kafka: KafkaConfig, topic: str, workload: Workload, rate: float | None = None) -> int:
    """Send the workload to ``topic`` (keyed by account), at most ``rate`` events per second;
    returns how many records were sent."""
    from confluent_kafka import Producer

    from oncekit.connectors.kafka import produce_when_room

    producer = Producer(kafka.settings(linger_ms=20, enable_idempotence=True))
    started = time.monotonic()
    sent = 0
    for event in events(workload):
        produce_when_room(producer, topic, key=event.key, value=event.value)
        sent += 1
        if rate:
            ahead = sent / rate - (time.monotonic() - started)
            if ahead > 0:
                time.sleep(ahead)
    producer.flush(60)
    return sent

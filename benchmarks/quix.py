"""Quix Streams copying one topic into another, run as its own process:

    python -m benchmarks.quix SERVERS SOURCE TARGET RECORDS GUARANTEE

It runs in an interpreter that has quixstreams (the ``bench`` extra): quixstreams pins
confluent-kafka below the version the kit needs, so ``make bench`` gives it its own venv.
Imports nothing but the standard library and quixstreams. Prints the seconds from creating the
Application to the end of ``run`` (interpreter start and imports are not the pipeline's).
"""

from __future__ import annotations

import sys
import tempfile
import time
import uuid
from typing import Any


def copy(servers: str, source: str, target: str, records: int, guarantee: str) -> float:
    """Copy ``records`` records from ``source`` to ``target`` (which exists) and stop;
    ``guarantee`` is "exactly-once" or "at-least-once"."""
    from quixstreams import Application

    with tempfile.TemporaryDirectory() as state:
        started = time.perf_counter()
        app: Any = Application(broker_address=servers, consumer_group=f"bench-quix-{uuid.uuid4().hex}",
                               auto_offset_reset="earliest", processing_guarantee=guarantee, state_dir=state,
                               loglevel="WARNING", use_changelog_topics=False)
        into = app.topic(target, key_serializer="bytes", value_serializer="bytes")
        app.dataframe(app.topic(source, key_deserializer="bytes", value_deserializer="bytes")).to_topic(into)
        app.run(count=records, timeout=60, collect=False)
        return time.perf_counter() - started


if __name__ == "__main__":
    servers, source, target, records, guarantee = sys.argv[1:6]
    print(copy(servers, source, target, int(records), guarantee))

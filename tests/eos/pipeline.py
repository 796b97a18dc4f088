"""The exactly-once suite's helpers; the example pipeline itself lives in ``oncekit.verify``."""

from __future__ import annotations

from typing import Any

from oncekit.core.spark.query import OncekitQuery, start_query
from oncekit.core.protocol import SinkConfig
from oncekit.verify import (  # noqa: F401  (re-exported for the tests)
    COUNT,
    PER_BATCH,
    integers,
    prepared_transactions,
    produce_input,
    read_committed,
    table_ids,
)


def run_available_now(frame: Any, sink: SinkConfig, checkpoint: str, notify: bool = False) -> OncekitQuery:
    """Run the stream until the input is drained; raises if the query fails (a crash)."""
    query = start_query(frame, sink, checkpoint, trigger={"availableNow": True}, notify=notify)
    query.await_termination()
    return query

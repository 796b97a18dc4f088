"""The exactly-once suite's helpers; the example pipeline itself lives in ``oncekit.verify``."""

from __future__ import annotations

import os
import random
import time
from typing import Any

from oncekit.core.spark.query import OncekitQuery, Trigger, start_query
from oncekit.core.spark.watchdog import STRAGGLER_S
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


CONNECTORS = ("oncekit", "spark")
"""Who reads the input topic in the crash-point tests: the kit's source or Spark's own."""


def with_connectors(cases: list[tuple[str, str]]) -> list[tuple[str, str, str]]:
    """The crash-point cases, each with the connector(s) that read its input: with
    ``ONCEKIT_CRASH_CONNECTORS=both`` (``make test-long``) every case with each connector; else
    (``make test``) each case with one, drawn from the run's seed, so that runs cover both."""
    both = os.environ.get("ONCEKIT_CRASH_CONNECTORS", "drawn") == "both"
    seed = os.environ["ONCEKIT_VERIFY_SEED"]
    return [(protocol, point, connector) for protocol, point in cases
            for connector in (CONNECTORS if both else [random.Random(f"{seed}:{protocol}:{point}").choice(CONNECTORS)])]


def drawn(options: list[str], runs_env: str, salt: int = 0) -> list[str]:
    """The campaign's runs of ``options``: as many as ``runs_env`` says (``make test``: 1 by
    default; ``make test-long``: all), drawn from the run's seed (plus ``salt``, so that two
    campaigns over the same options draw apart), in the order of ``options``: successive runs of
    the suite cover all of them."""
    runs = min(int(os.environ.get(runs_env, "1")), len(options))
    chosen = random.Random(int(os.environ["ONCEKIT_VERIFY_SEED"]) + salt).sample(options, runs)
    return sorted(chosen, key=options.index)


def read_by(query: OncekitQuery) -> str:
    """Which connector read a finished query's input: Spark's source names itself KafkaV2 in
    the query's progress, the kit's by its format."""
    description = query.recentProgress[-1]["sources"][0]["description"]
    return "spark" if description.startswith("KafkaV2") else "oncekit"


def run_available_now(frame: Any, sink: SinkConfig, checkpoint: str, notify: bool = False) -> OncekitQuery:
    """Run the stream until the input is drained; raises if the query fails (a crash)."""
    query = start_query(frame, sink, checkpoint, trigger=Trigger(available_now=True), notify=notify)
    query.await_termination()
    return query


def prepared_after_the_sweep(dsn: str, target: str = "") -> list[str]:
    """After a query failed: the prepared transactions of ``target``'s sinks once the driver's
    sweep of the failed run's stragglers had its time (:data:`STRAGGLER_S` after the failure,
    which comes at once), and at most a minute more."""
    deadline = time.monotonic() + STRAGGLER_S + 60
    while prepared_transactions(dsn, target) and time.monotonic() < deadline:
        time.sleep(0.5)
    return prepared_transactions(dsn, target)

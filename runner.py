"""``oncekit run``: a user's job under the kit's restart strategy, optionally as a standby.

A job is a function of the Spark session that starts its queries with
:func:`oncekit.start_query` and returns them (one query or a sequence), named
``path/to/job.py[:function]`` or ``package.module:function`` (the function defaults to
``start``)::

    from oncekit import kafka_stream, postgres_sink, start_query

    def start(spark):
        rows = kafka_stream(spark, "kafka:9092", "payments").selectExpr("CAST(value AS STRING) AS payload")
        return start_query(rows, postgres_sink(dsn, "payments", "two-phase-commit"), "s3a://bucket/checkpoints/payments")

Each attempt calls the function on the session and waits until every query it started has
ended (drained with ``availableNow``) or one failed; then it stops the others and the restart
strategy decides (:func:`~oncekit.core.restart.supervise`). Called by :mod:`oncekit.cli`; a
tool on top of the library, like the reference pipeline.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from oncekit.core.errors import ConfigError
from oncekit.core.restart import RestartStrategy, strategy_from_config, supervise
from oncekit.core.spark.query import OncekitQuery
from oncekit.core.spark.session import spark_session
from oncekit.core.spark.standby import stand_by
from oncekit.sources.kafka import WARM_UP_MODULES, analyze_for_warm_up

logger = logging.getLogger(__name__)

DEFAULT_RESTART = "fixed-delay:attempts=3,delay_s=1"
POLL_S = 0.5


def load_job(spec: str) -> Callable[[Any], Any]:
    """The job function ``spec`` names (``job.py[:function]`` or ``module:function``); ConfigError
    naming the file or module and the function when it cannot be loaded."""
    where, _, name = spec.rpartition(":") if ":" in spec else (spec, "", "")
    name = name or "start"
    if where.endswith(".py"):
        if not os.path.isfile(where):
            raise ConfigError(f"job {spec}: no file {where}")
        loader = importlib.util.spec_from_file_location(f"oncekit_job_{abs(hash(where))}", where)
        if loader is None or loader.loader is None:
            raise ConfigError(f"job {spec}: {where} cannot be loaded as Python")
        module = importlib.util.module_from_spec(loader)
        sys.path.insert(0, os.path.dirname(os.path.abspath(where)))  # the job's own modules beside it
        loader.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as exc:
            raise ConfigError(f"job {spec}: cannot import {where}: {exc}") from exc
    job = getattr(module, name, None)
    if not callable(job):
        raise ConfigError(f"job {spec}: {where} has no function {name}(spark) that starts the job's queries")
    return job  # type: ignore[no-any-return]


def parse_restart(text: str) -> RestartStrategy:
    """``fixed-delay:attempts=3,delay_s=1`` (the ``[restart]`` table of a pipeline config, on one line)."""
    kind, _, settings = text.partition(":")
    table: dict[str, Any] = {"type": kind}
    for item in filter(None, settings.split(",")):
        key, equals, value = item.partition("=")
        if not equals:
            raise ConfigError(f"restart strategy {text!r}: {item!r} is not key=value")
        table[key.strip()] = int(value) if value.strip().isdigit() else float(value)
    return strategy_from_config(table)


def _queries(job: str, started: Any) -> list[OncekitQuery]:
    queries = [started] if isinstance(started, OncekitQuery) else list(started or [])
    if not queries or not all(isinstance(query, OncekitQuery) for query in queries):
        raise ConfigError(f"job {job}: its function must return the queries it started with oncekit.start_query "
                          f"(one, or a list), not {started!r}")
    return queries


def attempt(job: str, start: Callable[[Any], Any], spark: Any) -> None:
    """One attempt: start the job's queries and wait until all ended, or one failed (then the
    others are stopped and its error raised, for the restart strategy)."""
    queries = _queries(job, start(spark))
    try:
        while any(query.isActive for query in queries) and not any(q.exception() is not None for q in queries):
            time.sleep(POLL_S)
    finally:
        failed = [query for query in queries if query.exception() is not None]
        for query in queries:
            if query not in failed and query.isActive:
                query.stop()
    for query in failed or queries:
        query.await_termination()  # raises a failed query's error; commits and releases an ended one's


def run_job(job: str, restart: str = DEFAULT_RESTART, standby: Sequence[str] = (), app_name: str = "oncekit-job") -> int:
    """``oncekit run``: run ``job`` under the restart strategy ``restart``; with ``standby`` (the
    job's checkpoint locations), warm up and wait until no other driver holds them first."""
    start, strategy = load_job(job), parse_restart(restart)
    session = functools.partial(spark_session, app_name)
    if standby:
        stand_by(session(), list(standby), announce=print, modules=WARM_UP_MODULES, analyze=analyze_for_warm_up)
        print("standby: taking over", flush=True)
    restarts = supervise(lambda: attempt(job, start, session()), strategy,
                         on_restart=lambda count, error: print(f"job {job} failed ({error}); restart {count}", flush=True))
    print(f"job {job} finished ({restarts} restarts)", flush=True)
    return 0

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
strategy decides (:func:`~oncekit.core.restart.supervise`). ``oncekit savepoint create
--checkpoint-root ROOT``, from any host, stops the job's queries checkpointed under ``ROOT`` at a
batch boundary with a savepoint (:mod:`oncekit.core.savepoint_stop`). Called by :mod:`oncekit.cli`; a
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

from oncekit.connectors.kafka import KafkaConfig, clusters_read
from oncekit.core import savepoint as savepoints
from oncekit.core.errors import ConfigError
from oncekit.core.protocol import SinkConfig
from oncekit.core.restart import RestartStrategy, strategy_from_config, supervise
from oncekit.core.spark.query import OncekitQuery
from oncekit.core.spark.session import spark_session
from oncekit.core.savepoint import identify
from oncekit.core.savepoint_stop import StopRequests
from oncekit.core.spark.standby import serve_as_standby
from oncekit.sinks.kafka.config import KafkaSinkConfig
from oncekit.sinks.postgres.config import PostgresSinkConfig
from oncekit.sources.warm_up import WARM_UP_MODULES, analyze_for_warm_up

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


class Attempt:
    """One attempt of a job: start its queries, wait until all ended, one failed (then the others
    are stopped and its error raised, for the restart strategy), or a stop-with-savepoint was
    asked for (``oncekit savepoint create --checkpoint-root ROOT``: then the queries stop at a batch
    boundary and the savepoint is taken, :attr:`saved`). ``on_started`` hears the started queries."""

    def __init__(self, job: str, start: Callable[[Any], Any],
                 on_started: Callable[[list[OncekitQuery]], None] = lambda queries: None) -> None:
        self.job, self.start, self.on_started = job, start, on_started
        self.saved: savepoints.Savepoint | None = None

    def __call__(self, spark: Any) -> None:
        queries = _queries(self.job, self.start(spark))
        self.on_started(queries)
        requests = StopRequests(sorted({_parent(query.checkpoint) for query in queries}))
        wanted = None
        try:
            while (any(query.isActive for query in queries) and not any(q.exception() is not None for q in queries)
                   and wanted is None):
                time.sleep(POLL_S)
                wanted = requests.take()
        finally:
            failed = [query for query in queries if query.exception() is not None]
            for query in queries:
                if query not in failed and query.isActive and wanted is not None:
                    query.stop_at_batch_boundary(stopped_with=f"savepoint {wanted.name}")
                elif query not in failed and query.isActive:
                    query.stop()
        for query in failed or queries:
            query.await_termination()  # raises a failed query's error; commits and releases an ended one's
        if wanted is not None:
            mine = {_name(query.checkpoint): identify(query.checkpoint) for query in queries
                    if _parent(query.checkpoint) == wanted.root}
            self.saved = savepoints.create(wanted.root, wanted.into, wanted.name, mine)
            requests.answered(wanted)


def _parent(checkpoint: str) -> str:
    """The checkpoint root a query's checkpoint is in (where stop requests for its job arrive)."""
    return savepoints.location(checkpoint).rpartition("/")[0]


def _name(checkpoint: str) -> str:
    """A query's name in a savepoint and on the status page: its checkpoint's folder name."""
    return savepoints.location(checkpoint).rpartition("/")[2]


def status_page(port: int, host: str = "127.0.0.1") -> Callable[[list[OncekitQuery]], None]:
    """``--ui``: serve the status page of the job's queries on ``host``:``port`` once they first
    started (kept across restarts; the [status] extra)."""
    try:
        from oncekit.status.collector import Watched
        from oncekit.status.command import protocols_of, start_page
    except ImportError as exc:
        raise ConfigError(f"oncekit run --ui: the status page needs the [status] extra (pip install 'oncekit[status]'): "
                          f"{exc}") from exc
    started: list[Any] = []

    def serve(queries: list[OncekitQuery]) -> None:
        if started:
            return
        watched = [Watched(_name(q.checkpoint), q.checkpoint, protocols_of(q.sink)) for q in queries]
        page = start_page(watched, port, *services_of([q.sink for q in queries]), host=host)
        started.append(page)
        print(f"status page: {page.url} (metrics at {page.url}metrics)", flush=True)

    return serve


def services_of(sinks: Sequence[SinkConfig]) -> tuple[KafkaConfig | None, str]:
    """The Kafka cluster and PostgreSQL database a job's status page asks (the runners' ``--ui``):
    the cluster the job's kit sources read from, else its Kafka sinks' (client settings
    included); its PostgreSQL sinks' database; else each from :func:`~oncekit.connectors.services.service_addresses`
    (the environment, or the services ``oncekit services up`` started)."""
    from oncekit.connectors.services import service_addresses

    flat = [config for sink in sinks for config in (*getattr(sink, "targets", {}).values(), sink)]
    kafka = next(iter(clusters_read()), None) or next(
        (KafkaConfig(c.bootstrap_servers, c.client) for c in flat if isinstance(c, KafkaSinkConfig)), None)
    dsn = next((c.dsn for c in flat if isinstance(c, PostgresSinkConfig)), "")
    bootstrap, dsn = service_addresses(None if kafka is None else kafka.bootstrap_servers, dsn or None)
    return kafka or (KafkaConfig(bootstrap) if bootstrap else None), dsn


def run_job(job: str, restart: str = DEFAULT_RESTART, standby: Sequence[str] = (), app_name: str = "oncekit-job",
            ui_port: int | None = None, ui_host: str = "127.0.0.1") -> int:
    """``oncekit run``: :func:`run` the function the job file or module ``job`` names."""
    return run(load_job(job), restart=restart, standby=standby, app_name=app_name, ui_port=ui_port, ui_host=ui_host,
               name=job)


def run(start: Callable[[Any], Any], *, restart: str | RestartStrategy = DEFAULT_RESTART, standby: Sequence[str] = (),
        app_name: str = "oncekit-job", ui_port: int | None = None, ui_host: str = "127.0.0.1", name: str = "") -> int:
    """Run a job as ``oncekit run`` does, from the job's own file: restarts, stop-with-savepoint
    from any host, the standby and the status page, for a job submitted with ``spark-submit``::

        if __name__ == "__main__":  # spark-submit job.py
            oncekit.run(start)

    :param start: the job: called with the Spark session, it starts the job's queries with
        :func:`~oncekit.start_query` and returns them (one, or a list).
    :param restart: when to start the queries again after a restartable error: a strategy
        (:class:`~oncekit.FixedDelay`...) or its one-line form, ``fixed-delay:attempts=3,delay_s=1``
        (the default), ``failure-rate:...``, ``exponential-backoff:...``, ``none``.
    :param standby: the job's query checkpoints: warm Spark up and wait until no other driver
        holds them before the first start, and wait again whenever another driver turns out to
        run them. Empty: start at once.
    :param app_name: Spark's application name, unless spark-submit gave one.
    :param ui_port: serve the status page and ``/metrics`` of the job's queries on this port.
    :param ui_host: the address the status page serves on (the loopback by default; ``0.0.0.0``
        for a Prometheus on another host).
    :param name: the job's name in what it prints (default: ``start``'s).
    :returns: 0, once the job's queries ended or stopped with a savepoint
        (``oncekit savepoint create --checkpoint-root ROOT`` from any host).
    :raises RestartsExhaustedError: the strategy gave up."""
    job = name or getattr(start, "__name__", "job")
    strategy = parse_restart(restart) if isinstance(restart, str) else restart
    session = functools.partial(spark_session, app_name)
    one = Attempt(job, start, status_page(ui_port, ui_host) if ui_port is not None else lambda queries: None)

    def restarted(count: int, error: BaseException) -> None:
        print(f"job {job} failed ({error}); restart {count}", flush=True)

    if standby:
        restarts = serve_as_standby(session, list(standby), lambda: one(session()), strategy, announce=print,
                                    took_over=lambda: print("standby: taking over", flush=True), on_restart=restarted,
                                    modules=WARM_UP_MODULES, analyze=analyze_for_warm_up)
    else:
        restarts = supervise(lambda: one(session()), strategy, on_restart=restarted)
    if one.saved is not None:
        print(f"stopped with savepoint {one.saved.name} at {one.saved.path}", flush=True)
    print(f"job {job} finished ({restarts} restarts)", flush=True)
    return 0

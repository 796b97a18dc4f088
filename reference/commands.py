"""What the ``oncekit`` commands do with the reference pipeline: ``pipeline run`` and
``produce``. The command line parses the flags and makes one call
here; each call prints what it did and returns the exit status.

``config_path`` and ``overrides`` (dotted keys, ``None`` values skipped) are read by
:func:`oncekit.reference.config.load_with_services`.
"""

from __future__ import annotations

import functools

import os
import sys
from collections.abc import Mapping
from contextlib import ExitStack
from typing import IO, TYPE_CHECKING, Any

from oncekit.connectors.kafka import KafkaConfig

from oncekit.connectors.kafka_admin import create_topic
from oncekit.connectors.services import load_state
from oncekit.core import savepoint as savepoints
from oncekit.core.savepoint_stop import StopRequests
from oncekit.core.spark.session import spark_session
from oncekit.core.spark.standby import stand_by
from oncekit.reference import generator
from oncekit.reference.config import load_with_services
from oncekit.reference.pipeline import QUERIES, WARM_UP_MODULES, ReferencePipeline
from oncekit.sources.warm_up import analyze_for_warm_up

if TYPE_CHECKING:
    from oncekit.status.app import StatusServer


def run_pipeline(config_path: str | None, overrides: Mapping[str, Any], from_savepoint: str | None = None,
                 ui_port: int | None = None, state_partitions: int | None = None, standby: bool = False) -> int:
    """``oncekit pipeline run``: run the pipeline under its restart strategy (from a savepoint, if
    given, its state rescaled to ``state_partitions`` if given) until it drains the topic, fails
    for good, or is asked to stop with a savepoint. With ``ui_port``, the status page serves on
    that port while it runs. With ``standby``, Spark and the queries' plans are made first, then
    it warms up and waits until no other driver holds the checkpoints
    (:func:`oncekit.core.spark.standby.stand_by`)."""
    pipeline = ReferencePipeline(load_with_services(config_path, overrides))
    session = functools.partial(spark_session, "oncekit-pipeline")
    spark = session()
    if standby:
        pipeline.queries(spark)  # the sources registered and the plans analyzed while it waits
        stand_by(spark, [f"{pipeline.checkpoint}/{name}" for name in QUERIES], announce=print, modules=WARM_UP_MODULES,
                 analyze=analyze_for_warm_up, plan=ReferencePipeline.warm_up_plan(pipeline.config.pipeline))
        print("standby: taking over", flush=True)
    if from_savepoint:
        restored = pipeline.restore(spark, from_savepoint, state_partitions)
        print(f"restored savepoint {restored.name} into {pipeline.checkpoint}")
        for note in savepoints.replay_notes(restored, {name: pipeline.sink() for name in QUERIES}):
            print(note)
    pipeline.prepare()
    requests = StopRequests(pipeline.checkpoint)
    with ExitStack() as stack:
        page = stack.enter_context(status_page(pipeline, ui_port)) if ui_port is not None else None
        restarts = pipeline.run_supervised(session, should_stop=requests.pending,
                                           on_restart=page.restarted if page is not None else None)
        wanted = requests.take()
        if wanted is not None:
            saved = pipeline.savepoint(spark, wanted.into, wanted.name)
            requests.answered(wanted)
            print(f"stopped with savepoint {saved.name} at {saved.path}")
    print(f"pipeline finished ({restarts} restarts); checkpoints under {pipeline.checkpoint}")
    return 0


def status_page(pipeline: ReferencePipeline, port: int, out: IO[str] = sys.stdout) -> StatusServer:
    """The status page of ``pipeline``'s query, serving on ``port`` (0: a free one) until the
    caller stops it; prints its address. For ``pipeline run --ui`` and ``demo --ui``."""
    from oncekit.status.command import for_runner

    name = QUERIES[0]
    page = for_runner(name, f"{pipeline.checkpoint}/{name}", pipeline.sink(), port, pipeline.bootstrap, pipeline.dsn)
    print(f"status page: {page.url} (metrics at {page.url}metrics)", file=out, flush=True)
    return page


def produce(bootstrap: str | None, topic: str, partitions: int, workload: generator.Workload,
            rate: float | None = None) -> int:
    """``oncekit produce``: create ``topic`` if needed and send the workload to it. The broker is
    ``bootstrap``, else ``ONCEKIT_KAFKA_BOOTSTRAP``, else the one ``oncekit services up`` started."""
    bootstrap = bootstrap or os.environ.get("ONCEKIT_KAFKA_BOOTSTRAP")
    if not bootstrap:
        running = load_state()
        if running is None:
            print("oncekit produce: give --bootstrap, set ONCEKIT_KAFKA_BOOTSTRAP, or run 'oncekit services up'",
                  file=sys.stderr)
            return 1
        bootstrap = running.kafka.bootstrap_servers
    kafka = KafkaConfig(bootstrap)
    create_topic(kafka, topic, partitions=partitions)
    sent = generator.produce(kafka, topic, workload, rate)
    print(f"sent {sent} records to {topic} at {bootstrap} (seed {workload.seed})")
    return 0

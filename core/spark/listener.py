"""Checkpoint-complete notifications from the user's driver process: a query listener that, on
every progress event of a run it watches, commits every decided batch up to the reported one,
acting for the run's epoch (:meth:`~oncekit.core.engine.CheckpointEngine.for_run`). Attached by
:func:`~oncekit.core.spark.query.start_query`, one per SparkSession; it reaches the journal and
Spark's logs through storage, like everything else."""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

from pyspark import SparkContext
from pyspark.java_gateway import ensure_callback_server_started
from pyspark.sql import SparkSession

from oncekit.core.protocol import SinkConfig
from oncekit.core.run import WatchedRun

logger = logging.getLogger(__name__)


class CheckpointListener:
    """Delivers checkpoint-complete notifications: on every progress event, commits every
    journaled batch up to the reported one; when the query is idle or stops, commits all that
    completed.

    Spark calls it through py4j, as the Java interface ``PythonStreamingQueryListener`` that
    pyspark's own listeners implement, and it reads only an event's query id and batch id.
    pyspark's :class:`~pyspark.sql.streaming.StreamingQueryListener` converts every progress
    event whole, over a hundred py4j calls, most of them the exception that ends each iteration
    of a Java map: py-spy found 270 ms of the driver's Python for each batch there, on the two
    cores that ran the batches (kit source into the transactional Kafka sink, 2,000 records/s,
    default trigger)."""

    class Java:
        implements = ["org.apache.spark.sql.streaming.PythonStreamingQueryListener"]

    def __init__(self) -> None:
        self._watched: dict[str, list[WatchedRun]] = {}
        self._terminated: dict[str, None] = {}  # the last runs whose termination notification has run
        self._lock = threading.Lock()

    def watch(self, run_id: str, config: SinkConfig, checkpoint: str, token: str = "") -> None:
        """Called by :func:`start_query` for Spark's run ``run_id`` of a query (a restarted
        query keeps its query id and gets a new run id): deliver that run's events, and only
        those, to the sink, with the epoch the kit's run ``token`` took."""
        with self._lock:
            self._watched.setdefault(run_id, []).append(WatchedRun(config, checkpoint, token))

    def _notify(self, run_id: str, up_to: int | None) -> None:
        with self._lock:
            watched = list(self._watched.get(run_id, []))
        for watch in watched:
            try:
                engine = watch.engine()
                committed = engine.complete(up_to) if engine is not None else []
                if committed:
                    logger.info("sink %s: checkpoints %s complete and committed", watch.config.sink_id, committed)
            except Exception as exc:  # the next batch's recovery retries; never kill the listener thread
                logger.error("sink %s: checkpoint-complete notification up to batch %s failed: %s",
                             watch.config.sink_id, up_to, exc)

    # Spark's listener bus calls these with the Java events (py4j objects).
    def onQueryStarted(self, event: Any) -> None:
        pass

    def onQueryProgress(self, event: Any) -> None:
        progress = event.progress()
        self._notify(progress.runId().toString(), progress.batchId())

    def onQueryIdle(self, event: Any) -> None:
        # A notification that failed (the sink's service unreachable) is retried here, while
        # no new batch comes whose recovery would retry it.
        self._notify(event.runId().toString(), None)

    def onQueryTerminated(self, event: Any) -> None:
        run_id = event.runId().toString()
        self._notify(run_id, None)
        with self._lock:
            self._watched.pop(run_id, None)
            self._terminated[run_id] = None
            if len(self._terminated) > 1_000:  # a process that restarts queries for days
                del self._terminated[next(iter(self._terminated))]

    def terminated(self, run_id: str) -> bool:
        """Whether this listener has delivered the termination notification of Spark's run ``run_id``."""
        with self._lock:
            return run_id in self._terminated


# Keyed by the session object itself (weakly): an id() would be reused by a later session
# once the first is garbage-collected, and the new session would get a listener it never added.
_listeners: weakref.WeakKeyDictionary[SparkSession, CheckpointListener] = weakref.WeakKeyDictionary()
_listeners_lock = threading.Lock()


def listener(spark: SparkSession) -> CheckpointListener:
    """The session's checkpoint listener, attached on first use."""
    with _listeners_lock:
        found = _listeners.get(spark)
        if found is None:
            found = _listeners[spark] = CheckpointListener()
            gateway = SparkContext._gateway
            assert gateway is not None, "a classic session has a py4j gateway"
            ensure_callback_server_started(gateway)  # type: ignore[no-untyped-call]  # as streams.addListener does
            wrapper = gateway.jvm.org.apache.spark.sql.streaming.PythonStreamingQueryListenerWrapper(found)
            spark._jsparkSession.streams().addListener(wrapper)
        return found



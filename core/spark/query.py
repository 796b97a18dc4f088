"""Starting queries with oncekit sinks, and the checkpoint-complete listener.

``start_query`` registers the sink's Spark format, attaches one :class:`CheckpointListener` per
SparkSession and starts the query. The listener runs in the user's driver process, where Spark
delivers query progress; it reaches the journal through storage, like everything else.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

from pyspark.sql import SparkSession
from pyspark.sql.streaming.listener import StreamingQueryListener

from oncekit.core.engine import CheckpointEngine
from oncekit.core.protocol import SinkConfig
from oncekit.core.spark.writer import QueryRun

if TYPE_CHECKING:
    from pyspark.sql import DataFrame
    from pyspark.sql.streaming.query import StreamingQuery


logger = logging.getLogger(__name__)

LAST_NOTIFICATION_WAIT_S = 60.0  # the listener's commit of the last batches; then the caller commits


class CheckpointListener(StreamingQueryListener):
    """Delivers checkpoint-complete notifications: on every progress event, commits every
    journaled batch up to the reported one; when the query is idle or stops, commits all that
    completed."""

    def __init__(self) -> None:
        self._watched: dict[str, list[tuple[SinkConfig, str]]] = {}
        self._terminated: dict[str, None] = {}  # the last queries whose termination notification has run
        self._lock = threading.Lock()

    def watch(self, query_id: str, config: SinkConfig, checkpoint: str) -> None:
        with self._lock:
            self._watched.setdefault(query_id, []).append((config, checkpoint))

    def _notify(self, query_id: str, up_to: int | None) -> None:
        with self._lock:
            watched = list(self._watched.get(query_id, []))
        for config, checkpoint in watched:
            try:
                committed = CheckpointEngine.of(config, checkpoint).complete(up_to)
                if committed:
                    logger.info("sink %s: checkpoints %s complete and committed", config.sink_id, committed)
            except Exception as exc:  # the next batch's recovery retries; never kill the listener thread
                logger.error("sink %s: checkpoint-complete notification up to batch %s failed: %s",
                             config.sink_id, up_to, exc)

    def onQueryStarted(self, event: Any) -> None:
        pass

    def onQueryProgress(self, event: Any) -> None:
        self._notify(str(event.progress.id), event.progress.batchId)

    def onQueryIdle(self, event: Any) -> None:
        # A notification that failed (the sink's service unreachable) is retried here, while
        # no new batch comes whose recovery would retry it.
        self._notify(str(event.id), None)

    def onQueryTerminated(self, event: Any) -> None:
        self._notify(str(event.id), None)
        with self._lock:
            self._watched.pop(str(event.id), None)
            self._terminated[str(event.id)] = None
            if len(self._terminated) > 1_000:  # a process that restarts queries for days
                del self._terminated[next(iter(self._terminated))]

    def terminated(self, query_id: str) -> bool:
        """Whether this listener has delivered the query's termination notification."""
        with self._lock:
            return query_id in self._terminated


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
            spark.streams.addListener(found)
        return found


class OncekitQuery:
    """A started query whose ``stop`` and ``await_termination`` end with a synchronous
    checkpoint-complete notification, so that once they return, every completed checkpoint's
    output is committed. Everything else is the StreamingQuery's own."""

    def __init__(self, query: StreamingQuery, sink: SinkConfig, checkpoint: str,
                 watcher: CheckpointListener | None = None) -> None:
        self.query, self.sink, self.checkpoint, self.watcher = query, sink, checkpoint, watcher

    def __getattr__(self, name: str) -> Any:
        return getattr(self.query, name)

    def complete(self) -> list[int]:
        """Commit every journaled checkpoint that Spark logged as committed."""
        return CheckpointEngine.of(self.sink, self.checkpoint).complete()

    def _stopped(self) -> None:
        # The listener commits the last batches (their progress events, then the termination);
        # wait until it has, rather than race it (two publishers of one Kafka batch fence each
        # other), then commit whatever it left.
        engine = CheckpointEngine.of(self.sink, self.checkpoint)
        deadline = time.monotonic() + LAST_NOTIFICATION_WAIT_S
        query_id = str(self.query.id)
        while (self.watcher is not None and not self.watcher.terminated(query_id) and engine.uncommitted()
               and time.monotonic() < deadline):
            time.sleep(0.05)
        engine.complete()

    def stop(self) -> None:
        self.query.stop()
        self._stopped()

    def await_termination(self, timeout: float | None = None) -> bool:
        """Like StreamingQuery.awaitTermination; raises the query's error if it failed."""
        finished = self.query.awaitTermination(timeout) if timeout is not None else self.query.awaitTermination()  # type: ignore[arg-type]
        if finished is None or finished:
            self._stopped()
            return True
        return False


def start_query(
    frame: DataFrame,
    sink: SinkConfig,
    checkpoint: str,
    *,
    trigger: dict[str, Any] | None = None,
    query_name: str | None = None,
    output_mode: str = "append",
    notify: bool = True,
) -> OncekitQuery:
    """Start ``frame`` into ``sink`` with checkpoint-complete notifications.

    ``trigger`` takes DataStreamWriter.trigger's keywords (``{"availableNow": True}``).
    With ``notify=False`` no listener is attached (as with a plain ``format(...)`` query):
    completion then reaches the sink when the next batch starts.
    """
    spark = frame.sparkSession
    spark.dataSource.register(sink.data_source())
    if "://" not in checkpoint and not checkpoint.startswith("file:"):
        checkpoint = os.path.abspath(checkpoint)
    run = QueryRun.started(listener=notify)
    writer = (frame.writeStream.format(sink.format_name).options(**sink.to_options(), **run.to_options())
              .option("checkpointLocation", checkpoint).outputMode(output_mode))
    if trigger:
        writer = writer.trigger(**trigger)
    if query_name:
        writer = writer.queryName(query_name)
    watcher = listener(spark) if notify else None
    query = writer.start()
    if watcher is not None:
        watcher.watch(str(query.id), sink, checkpoint)
    return OncekitQuery(query, sink, checkpoint, watcher)

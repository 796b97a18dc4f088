"""The plan a query was started with, kept beside its checkpoint, so that a batch its tasks
committed in part is replayed only by the plan that planned it.

Why: a sink that commits in its tasks (the transactional Kafka sink, alone or in a fan-out)
marks each (batch, partition index) it committed, and a replayed batch skips the indexes that
carry a marker. After a crash in the middle of batch N, a restart with another plan (a
``repartition(n)`` changed, another source option) replays N with rows in other partitions:
indexes without a marker write rows that a marked index already committed (duplicates), and
marked indexes skip rows that moved to them (loss). Spark keeps no plan in its checkpoint, and a
task cannot learn its stage's partition count, so :func:`refuse_changed_replay` compares the
analyzed plan's fingerprint with the one of the run that planned N, before any task runs.

``<checkpoint>/oncekit/plan``: the fingerprint of the newest run's plan. Written by
:func:`~oncekit.core.spark.query.start_query` only.
"""

from __future__ import annotations

import hashlib
import logging
import re
from typing import TYPE_CHECKING

from oncekit.core.errors import ConfigError
from oncekit.core.protocol import SinkConfig
from oncekit.core.spark_log import SparkLog
from oncekit.core.storage import filesystem, read_bytes, write_atomically

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

logger = logging.getLogger(__name__)

# What differs between two analyzations of one plan: expression ids (value#12, offset#4L), JVM
# object identities (PythonDataSourceV2@17f325e), the node ids Spark draws (EventTimeWatermark
# 46413dd7-7ae3-...) and the 64-bit seeds it draws for expressions given none
# (uuid(Some(-607...)), shuffle(a, Some(591...)), rand(447...)); a partition count
# (splits=Some(1), Repartition 4) is never ten digits long.
_VOLATILE = re.compile(r"#\d+L?\b|@[0-9a-f]+\b|\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b|-?\d{10,}")


def fingerprint(frame: DataFrame) -> str | None:
    """The fingerprint of ``frame``'s analyzed plan: operators, partition counts, source options,
    columns. None when the session cannot show the plan."""
    try:
        jdf = getattr(frame, "_jdf", None)
        if jdf is not None:
            text = str(jdf.queryExecution().analyzed().toString())
        else:  # Spark Connect: the server's explain of the plan
            explained = frame._explain_string(extended=True)  # type: ignore[operator]
            text = explained.split("== Analyzed Logical Plan ==", 1)[1].split("\n== ", 1)[0]
    except Exception as exc:  # noqa: BLE001 - a session that cannot say: nothing to compare
        logger.warning("the query's plan cannot be read (%s); a replay with another plan is not checked", exc)
        return None
    return hashlib.sha256(normalized(text).encode()).hexdigest()


def normalized(plan: str) -> str:
    """A plan's text without what differs between two analyzations of it (:data:`_VOLATILE`)."""
    return _VOLATILE.sub("#", plan)


class PlanRecord:
    """The fingerprint of the newest run's plan for the query checkpointed at ``checkpoint``."""

    def __init__(self, checkpoint: str) -> None:
        self.fs, root = filesystem(checkpoint)
        self.path = f"{root}/oncekit/plan"

    def read(self) -> str | None:
        try:
            return read_bytes(self.fs, self.path).decode() or None
        except FileNotFoundError:
            return None

    def write(self, fingerprint: str) -> None:
        write_atomically(self.fs, self.path, fingerprint.encode())


def refuse_changed_replay(frame: DataFrame, sink: SinkConfig, checkpoint: str) -> None:
    """Called by :func:`~oncekit.core.spark.query.start_query` before the query starts: when the
    checkpoint's newest batch is planned and not complete, its tasks may have committed part of
    it, and the sink commits in its tasks, the plan must be the one that planned it (ConfigError
    naming sink, batch and the way out). Then records this run's plan."""
    found = fingerprint(frame)
    if found is None:
        return
    record = PlanRecord(checkpoint)
    before = record.read()
    if before is not None and before != found:
        log = SparkLog(checkpoint)
        pending = log.latest_planned()
        if pending is not None and pending != log.latest_completed():
            built = sink.build(checkpoint)
            try:
                commits_in_task = built.commits_in_task
            finally:
                built.close()
            if commits_in_task:
                raise ConfigError(
                    f"sink {sink.sink_id} batch {pending}: the query's plan changed while batch {pending} was planned "
                    f"and not complete (checkpoint {checkpoint}). This sink commits in its tasks, so part of batch "
                    f"{pending} may be committed per partition, and a replay with another partitioning would write "
                    f"rows twice or skip them. Start once more with the earlier plan until batch {pending} is "
                    "complete (an availableNow trigger, for one), then start with the new one")
    if before != found:
        record.write(found)

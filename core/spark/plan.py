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

``<checkpoint>/oncekit/plan``: the newest run's :class:`Plan` (JSON; a fingerprint alone when
written before the settings were kept). Written by :func:`~oncekit.core.spark.query.start_query`
only.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
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

# A source's options, as an analyzed plan prints them: [key=value, key=value]. A replay reads the
# ranges the offset log holds, so only options that split a range into partitions (Spark's Kafka
# source; the kit's source's maxPartitions) decide where its rows go; the others (servers,
# starting offsets, the batch size, a client id made at each start) are left out, so that a start
# is refused only for a real change.
_OPTIONS = re.compile(r"\[([\w.]+=[^\]]*)\]")
PARTITIONING_OPTIONS = frozenset({"minpartitions", "maxrecordsperpartition", "maxpartitions"})

FILE_SPLIT_SETTINGS = ("spark.sql.files.maxPartitionBytes", "spark.sql.files.openCostInBytes",
                       "spark.sql.files.minPartitionNum", "spark.sql.files.maxPartitionNum",
                       "spark.sql.leafNodeDefaultParallelism")
"""The settings that split a file source's batch into partitions (the last defaults to the
cluster's cores), kept for a plan that reads files: a replay on another cluster size splits
the same files otherwise."""


@dataclass(frozen=True)
class Plan:
    """What a run's plan decides about a replay's partitioning: the fingerprint of its analyzed
    plan and, for a plan that reads files, the settings that split them (None: not set)."""

    fingerprint: str
    settings: Mapping[str, str | None] = field(default_factory=dict)
    earlier: str | None = field(default=None, compare=False)
    """The fingerprint an earlier version took of the same plan (:func:`earlier_normalized`), to
    compare with a record it wrote; never written."""

    def to_bytes(self) -> bytes:
        return json.dumps({"plan": self.fingerprint, "settings": dict(self.settings)}, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Plan:
        text = data.decode()
        if not text.startswith("{"):  # written before settings were kept: the fingerprint alone
            return cls(text)
        found = json.loads(text)
        return cls(found["plan"], found.get("settings", {}))


def plan_text(frame: DataFrame) -> str | None:
    """``frame``'s analyzed logical plan as Spark prints it; None (logged) when the session
    cannot show it."""
    try:
        jdf = getattr(frame, "_jdf", None)
        if jdf is not None:
            return str(jdf.queryExecution().analyzed().toString())
        explained = frame._explain_string(extended=True)  # type: ignore[operator]  # Spark Connect: the server's
        return str(explained.split("== Analyzed Logical Plan ==", 1)[1].split("\n== ", 1)[0])
    except Exception as exc:  # noqa: BLE001 - a session that cannot say: nothing to check
        logger.warning("the query's plan cannot be read (%s); it is not checked", exc)
        return None


def reads_spark_kafka(frame: DataFrame) -> bool:
    """Whether ``frame`` reads through Spark's own Kafka source (``format("kafka")``)."""
    return SPARK_KAFKA_SOURCE in (plan_text(frame) or "")


SPARK_KAFKA_SOURCE = "org.apache.spark.sql.kafka010.KafkaSourceProvider"
"""How Spark's Kafka source shows in an analyzed plan."""


def plan_of(frame: DataFrame) -> Plan | None:
    """``frame``'s :class:`Plan`; None when the session cannot show the plan."""
    text = plan_text(frame)
    if text is None:
        return None
    settings: dict[str, str | None] = {}
    if "FileSource[" in text:
        spark = frame.sparkSession
        settings = {name: spark.conf.get(name, None) for name in FILE_SPLIT_SETTINGS}
        if settings["spark.sql.leafNodeDefaultParallelism"] is None and hasattr(spark, "sparkContext"):
            settings["spark.sql.leafNodeDefaultParallelism"] = str(spark.sparkContext.defaultParallelism)
    return Plan(hashlib.sha256(normalized(text).encode()).hexdigest(), settings,
                earlier=hashlib.sha256(earlier_normalized(text).encode()).hexdigest())


def earlier_normalized(plan: str) -> str:
    """A plan's text as versions before the settings were kept fingerprinted it: without what
    differs between two analyzations of it, options and all kept."""
    return _VOLATILE.sub("#", plan)


def normalized(plan: str) -> str:
    """A plan's text without what differs between two analyzations of it (:data:`_VOLATILE`)
    and without the source options that leave a replay's partitioning alone."""
    return _OPTIONS.sub(_partitioning_options, earlier_normalized(plan))


def _partitioning_options(found: re.Match[str]) -> str:
    kept = [item for item in found.group(1).split(", ") if item.split("=", 1)[0].lower() in PARTITIONING_OPTIONS]
    return f"[{', '.join(kept)}]"


class PlanRecord:
    """The :class:`Plan` of the newest run of the query checkpointed at ``checkpoint``."""

    def __init__(self, checkpoint: str) -> None:
        self.fs, root = filesystem(checkpoint)
        self.path = f"{root}/oncekit/plan"

    def read(self) -> Plan | None:
        try:
            data = read_bytes(self.fs, self.path)
        except FileNotFoundError:
            return None
        return Plan.from_bytes(data) if data else None

    def write(self, plan: Plan) -> None:
        write_atomically(self.fs, self.path, plan.to_bytes())


def replay_refusal(sink_id: str, batch_id: int, checkpoint: str, before: Plan, now: Plan) -> str | None:
    """Why batch ``batch_id``, planned by ``before`` and not complete, cannot be replayed by
    ``now`` with a sink that commits in its tasks, and the way out; None when it can."""
    if before.fingerprint not in (now.fingerprint, now.earlier):
        return (f"sink {sink_id} batch {batch_id}: the query's plan changed while batch {batch_id} was planned and not "
                f"complete (checkpoint {checkpoint}). This sink commits in its tasks, so part of batch {batch_id} may be "
                "committed per partition, and a replay with another partitioning would write rows twice or skip them. "
                f"Start once more with the earlier plan until batch {batch_id} is complete (Trigger(available_now=True), "
                "for one), then start with the new one")
    changed = {name: value for name, value in before.settings.items() if now.settings.get(name) != value}
    if not changed:
        return None
    what = "; ".join(f"{name} was {value} and is {now.settings.get(name)} now" for name, value in changed.items())
    start_with = " ".join(f"--conf {name}={value}" for name, value in changed.items() if value is not None)
    return (f"sink {sink_id} batch {batch_id}: settings that split the query's files into partitions changed while "
            f"batch {batch_id} was planned and not complete (checkpoint {checkpoint}): {what}. This sink commits in "
            "its tasks, and a replay split otherwise would write rows twice or skip them. Start with the earlier "
            f"values ({start_with or 'unset them'}) until batch {batch_id} is complete, then with the new ones")


def refuse_changed_replay(frame: DataFrame, sink: SinkConfig, checkpoint: str) -> None:
    """Called by :func:`~oncekit.core.spark.query.start_query` before the query starts: when the
    checkpoint's newest batch is planned and not complete, its tasks may have committed part of
    it, and the sink commits in its tasks, the plan must be the one that planned it, with the
    same file split settings (ConfigError naming sink, batch and the way out). Then records
    this run's plan."""
    found = plan_of(frame)
    if found is None:
        return
    record = PlanRecord(checkpoint)
    before = record.read()
    if before is not None and before != found:
        log = SparkLog(checkpoint)
        pending = log.latest_planned()
        refusal = replay_refusal(sink.sink_id, pending, checkpoint, before, found) if pending is not None else None
        if refusal is not None and pending != log.latest_completed():
            built = sink.build(checkpoint)
            try:
                commits_in_task = built.commits_in_task
            finally:
                built.close()
            if commits_in_task:
                raise ConfigError(refusal)
    if before != found:
        record.write(found)

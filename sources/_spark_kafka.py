"""The thin Spark adapter of the Kafka source: PySpark's DataSource classes, camelCase inside."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any, cast

from confluent_kafka import ConsumerGroupTopicPartitions, TopicPartition
from confluent_kafka.admin import AdminClient
from pyspark.sql.datasource import DataSource, DataSourceReader, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadLimit, ReadMaxRows, SupportsTriggerAvailableNow
from pyspark.sql.types import StructType

from oncekit.sources._reader import KafkaPartitionReader, KafkaRange
from oncekit.sources.kafka import (
    FORMAT,
    HEADERS_FIELD,
    SCHEMA,
    KafkaSourceOptions,
    Offsets,
    _resolve,
    check_partitions,
    starting_offsets,
    watermarks,
)

logger = logging.getLogger(__name__)


class KafkaTask(InputPartition):
    """One task's work: its ranges, read together by one consumer."""

    def __init__(self, ranges: tuple[KafkaRange, ...]) -> None:
        self.ranges = ranges

    def __repr__(self) -> str:
        return "KafkaTask(" + ", ".join(f"{r.topic}-{r.partition} [{r.start}, {r.end})" for r in self.ranges) + ")"


def _ranges(start: Offsets, end: Offsets) -> list[KafkaRange]:
    return [
        KafkaRange(topic, int(partition), start.get(topic, {}).get(partition, 0), stop)
        for topic, partitions in sorted(end.items())
        for partition, stop in sorted(partitions.items(), key=lambda item: int(item[0]))
        if stop > start.get(topic, {}).get(partition, 0)
    ]


def _tasks(ranges: list[KafkaRange], max_partitions: int | None) -> list[KafkaTask]:
    """The batch's tasks: a task per range, or with ``max_partitions`` at most that many, each
    range going to the task with the fewest records so far (larger ranges first). A function of
    the ranges and the option alone, so that a replayed batch, which Spark plans from the same
    offsets, puts every range in the task of the same index as its first run did."""
    if max_partitions is None or len(ranges) <= max_partitions:
        return [KafkaTask((r,)) for r in ranges]
    groups: list[list[KafkaRange]] = [[] for _ in range(max_partitions)]
    loads = [0] * max_partitions
    for found in sorted(ranges, key=lambda r: (r.start - r.end, r.topic, r.partition)):
        index = min(range(max_partitions), key=lambda i: (loads[i], i))
        groups[index].append(found)
        loads[index] += found.end - found.start
    return [KafkaTask(tuple(sorted(group, key=lambda r: (r.topic, r.partition)))) for group in groups]


def _read(options: KafkaSourceOptions, partition: InputPartition) -> Iterator[Any]:
    return KafkaPartitionReader(options).read(cast(KafkaTask, partition).ranges)  # Spark hands back what partitions() returned


class KafkaDataSource(DataSource):
    @classmethod
    def name(cls) -> str:
        return FORMAT

    def schema(self) -> str:
        options = KafkaSourceOptions.parse(self.options)
        return SCHEMA + (", " + HEADERS_FIELD if options.include_headers else "")

    def reader(self, schema: StructType) -> DataSourceReader:
        return KafkaBatchReader(KafkaSourceOptions.parse(self.options))

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return KafkaStreamReader(KafkaSourceOptions.parse(self.options))


class KafkaBatchReader(DataSourceReader):
    def __init__(self, options: KafkaSourceOptions) -> None:
        self.options = options

    def partitions(self) -> Sequence[InputPartition]:
        marks = watermarks(self.options)
        return _tasks(_ranges(starting_offsets(self.options, marks),
                              _resolve(self.options.ending_offsets, marks, "endingOffsets")), self.options.max_partitions)

    def read(self, partition: InputPartition) -> Iterator[Any]:
        return _read(self.options, partition)


class KafkaStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Driver side: plans offset ranges; Spark checkpoints them in its offset log."""

    def __init__(self, options: KafkaSourceOptions) -> None:
        self.options = options
        self._available_now: Offsets | None = None
        self._group_admin: AdminClient | None = None

    def prepareForTriggerAvailableNow(self) -> None:
        """Trigger.AvailableNow reads what exists now and no later record, in as many batches
        as maxOffsetsPerTrigger needs."""
        self._available_now = {}
        for (topic, partition), (_, high) in watermarks(self.options).items():
            self._available_now.setdefault(topic, {})[str(partition)] = high

    def initialOffset(self) -> dict[str, Any]:
        return starting_offsets(self.options, watermarks(self.options))

    def getDefaultReadLimit(self) -> ReadLimit:
        limit = self.options.max_offsets_per_trigger
        return ReadMaxRows(limit) if limit else ReadAllAvailable()

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        latest: Offsets = {}
        marks = watermarks(self.options)
        check_partitions(self.options, start, marks)
        for (topic, partition), (_, high) in marks.items():
            stop = (self._available_now or {}).get(topic, {}).get(str(partition), high)
            latest.setdefault(topic, {})[str(partition)] = min(high, stop)
        if isinstance(limit, ReadMaxRows):
            latest = _cap(start, latest, limit.max_rows)
        return latest

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        return _tasks(_ranges(start, end), self.options.max_partitions)

    def read(self, partition: InputPartition) -> Iterator[Any]:
        return _read(self.options, partition)

    def commit(self, end: dict[str, Any]) -> None:
        """Called on the driver when the next batch starts: mirror offsets to the consumer group
        for lag monitoring. Never read back for recovery. An admin request that is not waited
        for (a consumer's commit, even an asynchronous one, makes its close wait for a group
        coordinator): one that does not answer never holds the query, which Spark calls this
        from between batches, outside the batch deadline. A failed mirror is logged."""
        group = self.options.consumer_group
        if not group:
            return
        if self._group_admin is None:  # one per query, outliving its requests (or librdkafka cancels them)
            self._group_admin = AdminClient({k: v for k, v in self.options.client.items() if k != "isolation.level"})

        def mirrored(future: Any) -> None:
            if future.exception() is not None:
                logger.warning("%s: could not mirror offsets to group %s: %s", FORMAT, group, future.exception())

        offsets = [TopicPartition(t, int(p), o) for t, parts in end.items() for p, o in parts.items()]
        try:
            requests = self._group_admin.alter_consumer_group_offsets(
                [ConsumerGroupTopicPartitions(group, offsets)], request_timeout=30)
        except Exception as exc:  # monitoring only: a failed mirror must not fail the query
            logger.warning("%s: could not mirror offsets to group %s: %s", FORMAT, group, exc)
            return
        for request in requests.values():
            request.add_done_callback(mirrored)


def _cap(start: Offsets, latest: Offsets, max_rows: int) -> Offsets:
    """Spread ``max_rows`` over the partitions in proportion to their backlog (as Spark's own
    Kafka source does), at least one record for any partition with a backlog."""
    backlog = {
        (t, p): latest[t][p] - start.get(t, {}).get(p, 0) for t in latest for p in latest[t]
    }
    total = sum(max(0, b) for b in backlog.values())
    if total <= max_rows:
        return latest
    capped: Offsets = {}
    for (topic, partition), lag in backlog.items():
        begin = start.get(topic, {}).get(partition, 0)
        share = 0 if lag <= 0 else max(1, lag * max_rows // total)
        capped.setdefault(topic, {})[partition] = begin + min(lag, share) if lag > 0 else latest[topic][partition]
    return capped

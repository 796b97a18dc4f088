"""The Kafka source's task side: a task's ranges of topic-partitions, read by one consumer of
the worker's pool into Arrow record batches (:mod:`oncekit.sources.kafka` plans the ranges; the
Spark adapter, :mod:`oncekit.sources._spark_kafka`, hands each task its own)."""

from __future__ import annotations

import bisect
import itertools
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, cast

import numpy as np
import pyarrow as pa
from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition

from oncekit.connectors.kafka import attempt_timeout, retrying
from oncekit.core.errors import DataLossError, SourceReadError
from oncekit.sources.kafka import FORMAT, KafkaSourceOptions

logger = logging.getLogger(__name__)

_TIMESTAMP = pa.timestamp("us", tz="UTC")  # Spark's timestamp in Arrow


@dataclass(frozen=True)
class KafkaRange:
    """Records [start, end) of one topic-partition: what a batch reads of it."""

    topic: str
    partition: int
    start: int
    end: int


class KafkaPartitionReader:
    """Reads a task's ranges of topic-partitions, all assigned to one consumer at once (its
    fetches go to every partition together), and yields Arrow batches, each of one partition.

    A range ends on the consumer's position, never on the offset end-1: transaction markers
    and aborted records occupy offsets, so the last offsets of a range may carry no record.
    A read never waits out a timeout once the ranges' last records have arrived: each poll asks
    for at most what is left, and polls are short, so ranges that end on a transaction marker
    cost one short poll more for the task, not a second per range. Records of one partition come
    in their log's order; batches of different partitions may interleave differently in a replay
    (the sinks' checksums and keys do not depend on it).
    """

    POLL_S = 0.1

    def __init__(self, options: KafkaSourceOptions) -> None:
        self.options = options

    def read(self, ranges: Sequence[KafkaRange]) -> Iterator[pa.RecordBatch]:
        pending = {(r.topic, r.partition): r for r in ranges if r.start < r.end}
        if not pending:
            return
        paused: list[TopicPartition] = []
        with self.options.borrowed_consumer() as consumer:
            try:
                yield from self._read(consumer, pending, paused)
            finally:
                if paused:  # a pooled consumer keeps a partition's pause across assignments
                    consumer.resume(paused)
                consumer.unassign()  # the next task assigns afresh; position() is -1001 until it fetches

    def _read(self, consumer: Consumer, pending: dict[tuple[str, int], KafkaRange],
              paused: list[TopicPartition]) -> Iterator[pa.RecordBatch]:
        """Read until every range's partition is at or past its end; ``pending`` holds each
        range still being read, its start moved to where the reading stands; ``paused`` gets
        each partition read to its end, paused so that it fetches no further."""
        consumer.assign([TopicPartition(t, p, r.start) for (t, p), r in pending.items()])
        deadline = time.monotonic() + self.options.poll_timeout_s
        while pending:
            left = sum(r.end - r.start for r in pending.values())
            messages = consumer.consume(num_messages=min(self.options.batch_size, left), timeout=self.POLL_S)
            failed = list(filter(Message.error, messages))  # one scan, in C; _to_arrow trusts it
            if failed:
                other = next((e for e in map(Message.error, failed)
                              if cast(KafkaError, e).code() != KafkaError._AUTO_OFFSET_RESET), None)
                if other is not None:
                    raise KafkaException(other)
                # The log does not hold an offset (auto.offset.reset=error): only now ask where it starts.
                for message in failed:
                    key = (cast(str, message.topic()), cast(int, message.partition()))
                    if key in pending:
                        current = pending[key]
                        pending[key] = replace(current, start=self._skip_lost(consumer, *key, current.start, current.end))
                pending = {key: r for key, r in pending.items() if r.start < r.end}
                consumer.assign([TopicPartition(t, p, r.start) for (t, p), r in pending.items()])
                continue
            for (topic, partition), run in _runs(messages):
                reading = pending.get((topic, partition))
                if reading is not None:  # else a paused partition's prefetched records, past its end
                    batch = self._to_arrow(topic, partition, run, reading.end)
                    if batch.num_rows:
                        yield batch
            if messages:
                deadline = time.monotonic() + self.options.poll_timeout_s
            positions = consumer.position([TopicPartition(t, p) for t, p in pending])
            for position in positions:
                key = (position.topic, position.partition)
                if position.offset >= 0:  # -1001: nothing fetched yet
                    pending[key] = replace(pending[key], start=position.offset)
            done = [key for key, r in pending.items() if r.start >= r.end]
            if done:
                ended = [TopicPartition(t, p) for t, p in done]
                consumer.pause(ended)
                paused += ended
                pending = {key: r for key, r in pending.items() if r.start < r.end}
            if pending and not messages and time.monotonic() > deadline:
                stuck = next(iter(pending.values()))
                raise SourceReadError(
                    f"{FORMAT}: topic {stuck.topic} partition {stuck.partition}: stuck at offset {stuck.start} "
                    f"before {stuck.end} for {self.options.poll_timeout_s:.0f} s"
                )

    def _skip_lost(self, consumer: Consumer, topic: str, partition: int, position: int, end: int) -> int:
        """Where to read on from when the log no longer holds ``position`` (retention deleted
        it, or the topic was recreated): DataLossError, or with ``failOnDataLoss=false`` a
        warning and the log's first offset."""
        low, high = _watermarks(consumer, topic, partition)
        if position < low:
            lost = f"{FORMAT}: topic {topic} partition {partition}: offsets {position}..{min(low, end) - 1} are gone (log starts at {low})"
        else:
            lost = (f"{FORMAT}: topic {topic} partition {partition}: offset {position} is beyond the log's end {high} "
                    "(topic recreated?)")
            low = end
        if self.options.fail_on_data_loss:
            raise DataLossError(lost + "; set failOnDataLoss=false to skip them")
        logger.warning("%s; skipped", lost)
        return low

    def _to_arrow(self, topic: str, partition: int, messages: list[Any], end: int) -> pa.RecordBatch:
        """The messages before ``end`` as one Arrow batch. librdkafka hands out one object per
        message, so each column takes one ``map`` of a C accessor over them (no Python code per
        message); topic and partition are constants of the range. Called with messages that
        carry no error (:meth:`_read` looked)."""
        offsets = cast(list[int], list(map(Message.offset, messages)))  # fetched messages have offsets
        # prefetched records past the range belong to the next batch
        count = bisect.bisect_left(offsets, end)
        if count < len(messages):
            messages, offsets = messages[:count], offsets[:count]
        # (type, milliseconds) per message, flattened in C: transposing the tuples in Python
        # (zip) took half of this method's time
        stamps = np.fromiter(itertools.chain.from_iterable(map(Message.timestamp, messages)), np.int64,
                             2 * count).reshape(count, 2)
        columns = [
            pa.array(list(map(Message.key, messages)), pa.binary()),
            pa.array(list(map(Message.value, messages)), pa.binary()),
            pa.repeat(pa.scalar(topic, pa.string()), count),
            pa.repeat(pa.scalar(partition, pa.int32()), count),
            pa.array(offsets, pa.int64()),
            pa.array(stamps[:, 1] * 1000, _TIMESTAMP),
            # librdkafka counts types from 0 = none, Kafka's Java client (and Spark) from -1 = none
            pa.array(stamps[:, 0] - 1, pa.int32()),
        ]
        names = ["key", "value", "topic", "partition", "offset", "timestamp", "timestampType"]
        if self.options.include_headers:
            header_type = pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())]))
            columns.append(pa.array([[{"key": k, "value": v} for k, v in (m.headers() or [])] for m in messages],
                                    header_type))
            names.append("headers")
        return pa.RecordBatch.from_arrays(columns, names=names)


def _runs(messages: list[Any]) -> Iterator[tuple[tuple[str, int], list[Any]]]:
    """The messages of one consume call, cut where their topic-partition changes (librdkafka
    hands them out a partition's fetched run at a time); each run with its (topic, partition)."""
    for topic, of_topic in itertools.groupby(messages, Message.topic):
        for partition, run in itertools.groupby(of_topic, Message.partition):
            yield (cast(str, topic), cast(int, partition)), list(run)


def _watermarks(consumer: Consumer, topic: str, partition: int) -> tuple[int, int]:
    """(low, high) of one partition, asked again while a broker restarts or its leader moves, so
    that a short broker outage delays the batch instead of failing the query."""
    attempts = itertools.count()
    return retrying(f"{FORMAT}: watermarks of {topic}[{partition}]",
                    lambda: consumer.get_watermark_offsets(TopicPartition(topic, partition),
                                                           timeout=attempt_timeout(next(attempts))))

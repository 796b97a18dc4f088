"""The at-least-once Kafka sink: an idempotent producer flushed at the end of each task; a
replayed batch writes its records again."""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa
from confluent_kafka import KafkaException

from oncekit.core.errors import OncekitError, RecordError
from oncekit.core.bases import AtLeastOnceSink
from oncekit.core.protocol import TaskInfo
from oncekit.sinks.kafka._common import FORMAT, KafkaSinkBase
from oncekit.sinks.kafka._records import RecordStream


class KafkaAtLeastOnceSink(KafkaSinkBase, AtLeastOnceSink):
    """Delivery errors fail the task; nothing is left to commit."""

    def append(self, task: TaskInfo, batches: Iterator[pa.RecordBatch]) -> int:
        where = f"{FORMAT} sink {self.sink_id} batch {task.batch_id} partition {task.partition_id}"
        producer = self.take_producer(None)
        producer.failures.clear()
        rows = 0
        try:
            for part in RecordStream.of(batches, where):  # sent as it arrives
                self.produce(producer, part, where, first_row=rows)
                rows += len(part)
        except KafkaException as exc:
            raise OncekitError(f"{where}: produce failed: {exc.args[0].str()}") from exc
        remaining = producer.flush(60)
        errors = producer.failures
        if errors or remaining:
            raise RecordError(f"{where}: {len(errors) + remaining} records were not delivered: {(errors or ['timeout'])[0]}")
        self.give_producer(None, producer)
        return rows

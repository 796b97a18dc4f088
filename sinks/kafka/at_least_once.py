"""The at-least-once Kafka sink: an idempotent producer flushed at the end of each task; a
replayed batch writes its records again."""

from __future__ import annotations

from collections.abc import Iterator
import pyarrow as pa

from oncekit.core.errors import RecordError
from oncekit.core.protocol import AtLeastOnceSink, TaskInfo
from oncekit.sinks.kafka._common import FORMAT, KafkaSinkBase, Records


class KafkaAtLeastOnceSink(KafkaSinkBase, AtLeastOnceSink):
    """Delivery errors fail the task; nothing is left to commit."""

    def append(self, task: TaskInfo, batches: Iterator[pa.RecordBatch]) -> int:
        where = f"{FORMAT} sink {self.sink_id} batch {task.batch_id} partition {task.partition_id}"
        records = Records.from_batches(batches, where)
        producer = self.take_producer(None)
        delivery_errors = self.produce(producer, records, where)
        remaining = producer.flush(60)
        if delivery_errors() or remaining:
            errors = delivery_errors()
            raise RecordError(f"{where}: {len(errors) + remaining} records were not delivered: {(errors or ['timeout'])[0]}")
        self.give_producer(None, producer)
        return len(records)

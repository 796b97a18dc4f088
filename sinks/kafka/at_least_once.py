"""The at-least-once Kafka sink: an idempotent producer flushed at the end of each task; a
replayed batch writes its records again."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pyarrow as pa

from oncekit.core.errors import RecordError
from oncekit.core.protocol import AtLeastOnceSink, TaskInfo
from oncekit.sinks.kafka._common import FORMAT, KafkaSinkBase, Records


class KafkaAtLeastOnceSink(KafkaSinkBase, AtLeastOnceSink):
    """Delivery errors fail the task; nothing is left to commit."""

    def append(self, task: TaskInfo, batches: Iterator[pa.RecordBatch]) -> int:
        where = f"{FORMAT} sink {self.sink_id} batch {task.batch_id} partition {task.partition_id}"
        records = Records.from_batches(batches, where)
        producer = self.producer(enable_idempotence=True)
        errors: list[str] = []

        def delivered(error: Any, message: Any) -> None:
            if error is not None:
                errors.append(str(error))

        for index, (key, value) in enumerate(zip(records.keys, records.values)):
            self._produce(producer, key, value, delivered, where, index)
        remaining = producer.flush(60)
        if errors or remaining:
            raise RecordError(f"{where}: {len(errors) + remaining} records were not delivered: {(errors or ['timeout'])[0]}")
        return len(records.values)

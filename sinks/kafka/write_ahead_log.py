"""The write-ahead-log Kafka sink: tasks stage rows under the checkpoint; once the checkpoint is
complete, one transaction publishes the batch with its marker (one marker group per sink), so
output is visible only after the checkpoint, as with Flink."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING


from oncekit.core.errors import OncekitError
from oncekit.core.names import KafkaTransactionalId, MarkerGroup
from oncekit.core.protocol import CommitOutcome, Committable, WriteAheadSink
from oncekit.core.staging import StagedFiles
from oncekit.sinks.kafka._common import FORMAT, KafkaSinkBase, RecordStream, SinkProducer

if TYPE_CHECKING:
    from oncekit.sinks.kafka.config import KafkaSinkConfig


class KafkaWriteAheadSink(KafkaSinkBase, WriteAheadSink):
    """Tasks stage; the checkpoint-complete notification publishes the batch in one transaction."""

    def __init__(self, config: KafkaSinkConfig, checkpoint: str) -> None:
        super().__init__(config)
        self.staged = StagedFiles(checkpoint, config.sink_id)

    def send_values(self, batch_id: int, committables: Sequence[Committable]) -> CommitOutcome:
        where = f"{FORMAT} sink {self.sink_id} batch {batch_id}"
        group = MarkerGroup(self.sink_id)
        if self.marker(group)[0] > batch_id:
            return CommitOutcome.ALREADY_COMMITTED
        # Each staged file is read and sent in turn, with librdkafka sending while the next is read.
        records = RecordStream(itertools.chain.from_iterable(
            RecordStream.of(batches, f"{where} partition {committable.partition_id}")
            for committable, batches in self.staged_batches(batch_id, committables)
        ))

        def attempt(producer: SinkProducer) -> int:
            if self.marker(group)[0] > batch_id:  # published by another notification meanwhile
                return 0
            return self.publish(producer, records, group, batch_id, where)

        try:
            published = self.commit_with_fencing(KafkaTransactionalId(self.sink_id), where, attempt)
        except OncekitError:
            # Two notifications for one batch fence each other; the one that wins publishes it.
            if self._wait_for_marker(group, batch_id):
                return CommitOutcome.ALREADY_COMMITTED
            raise
        return CommitOutcome.COMMITTED if published or not any(c.rows for c in committables) else CommitOutcome.ALREADY_COMMITTED

    def _wait_for_marker(self, group: MarkerGroup, batch_id: int, timeout_s: float = 60.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.marker(group)[0] > batch_id:
                return True
            time.sleep(1.0)
        return False

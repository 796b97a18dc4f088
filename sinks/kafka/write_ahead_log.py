"""The write-ahead-log Kafka sink: tasks stage rows under the checkpoint; once the checkpoint is
complete, one transaction publishes the batch with its marker (one marker per sink), so
output is visible only after the checkpoint, as with Flink. A publisher whose latest marker is a
newer run's publishes nothing (FencedError)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

from confluent_kafka import KafkaException

from oncekit.core import clock
from oncekit.core.errors import OncekitError
from oncekit.core.names import KafkaTransactionalId
from oncekit.core.bases import WriteAheadSink
from oncekit.core.protocol import CommitOutcome, Committable
from oncekit.core.staging import StagedFiles
from oncekit.sinks.kafka._batch_marker import BatchMarker
from oncekit.sinks.kafka._common import FORMAT, KafkaSinkBase, SinkProducer
from oncekit.sinks.kafka._markers import READ_S, SETTLE_S
from oncekit.sinks.kafka._records import RecordStream, checksum

if TYPE_CHECKING:
    from oncekit.sinks.kafka.config import KafkaSinkConfig


PUBLISHER = 0
"""The publisher's writer index in the marker topic: one marker per sink."""


class KafkaWriteAheadSink(KafkaSinkBase, WriteAheadSink):
    """Tasks stage; the checkpoint-complete notification publishes the batch in one transaction."""

    def __init__(self, config: KafkaSinkConfig, checkpoint: str) -> None:
        super().__init__(config)
        self.staged = StagedFiles(checkpoint, config.sink_id)

    def send_values(self, batch_id: int, committables: Sequence[Committable]) -> CommitOutcome:
        where = f"{FORMAT} sink {self.sink_id} batch {batch_id}"
        # Each staged file is read and sent in turn, with librdkafka sending while the next is read.
        records = RecordStream(itertools.chain.from_iterable(
            RecordStream.of(batches, f"{where} partition {committable.partition_id}")
            for committable, batches in self.staged_batches(batch_id, committables)
        ))

        def attempt(producer: SinkProducer) -> int:
            # Published before (a repeated notification, or another one meanwhile)? A new
            # producer's init_transactions has settled the id: its read may wait longer.
            marker = self.markers.latest(PUBLISHER, where, READ_S if producer.fresh else SETTLE_S)
            if marker is not None:
                marker.refuse_newer(self.epoch, where)
            if marker is None or marker.is_empty:
                return self.publish(producer, records, PUBLISHER, batch_id, where,
                                    lambda rows, checksum: BatchMarker(batch_id, rows, checksum, epoch=self.epoch))
            if marker.batch_id == batch_id or (marker.batch_id > batch_id and self._replay_matches(
                    marker, batch_id, committables, where)):
                return -1
            return self.publish(producer, records, PUBLISHER, batch_id, where,
                                lambda rows, checksum: marker.replayed(batch_id, rows, checksum, where, self.epoch))

        try:
            published = self.commit_with_fencing(KafkaTransactionalId(self.sink_id), where, attempt)
        except OncekitError as exc:
            # Two notifications for one batch fence each other; the one that wins publishes it.
            # Any other failure (a broker out of reach) is the caller's to retry at once: waiting
            # here for a marker nobody else writes only held the batch up.
            fenced = isinstance(exc.__cause__, KafkaException) and exc.__cause__.args[0].fatal()
            if fenced and self._wait_for_marker(batch_id, where):
                return CommitOutcome.ALREADY_COMMITTED
            raise
        if published < 0:
            return CommitOutcome.ALREADY_COMMITTED
        return CommitOutcome.COMMITTED if published or not any(c.rows for c in committables) else CommitOutcome.ALREADY_COMMITTED

    def _replay_matches(self, marker: BatchMarker, batch_id: int, committables: Sequence[Committable],
                        where: str) -> bool:
        """A batch older than the last one published: either another notification published it
        and discarded its staged files since (True), or the checkpoint is older than the sink's
        output (an old savepoint restored) and the staged replay is compared with what was
        published then (:meth:`BatchMarker.replayed`: True when the same, raises when not, False
        for a batch the publisher never had: publish it)."""
        rows = crc_total = 0
        try:
            for committable, batches in self.staged_batches(batch_id, committables):
                for part in RecordStream.of(batches, f"{where} partition {committable.partition_id}"):
                    rows, crc_total = rows + len(part), crc_total + part.crc_total
        except FileNotFoundError:
            return True
        return marker.replayed(batch_id, rows, checksum(rows, crc_total), where, self.epoch) is None

    def transactional_id_of(self, writer: int) -> KafkaTransactionalId:
        """The publisher's: it writes the one marker partition of the sink (writer 0)."""
        return KafkaTransactionalId(self.sink_id)

    def _wait_for_marker(self, batch_id: int, where: str, timeout_s: float = 60.0) -> bool:
        deadline = clock.monotonic() + timeout_s
        while clock.monotonic() < deadline:
            try:
                marker = self.markers.latest(PUBLISHER, where)
            except OncekitError:
                marker = None  # unsettled or unreachable for now: look again
            if marker is not None and marker.batch_id >= batch_id:
                return True
            clock.sleep(1.0)
        return False

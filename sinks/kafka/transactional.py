"""The transactional Kafka sink: each task writes through a producer whose ``transactional.id``
is stable per (sink, partition), so a zombie attempt is fenced, and commits at the end of the
task with its batch marker. A replayed batch finds its marker (the latest, or one the latest
remembers) and writes nothing (the records it streamed into its transaction are aborted); a
checksum that differs exposes a non-deterministic replay, and a batch older than the markers
remember is refused (:meth:`BatchMarker.replayed`). Output is visible as soon as each task
commits."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pyarrow as pa

from oncekit.core.deadline import begin
from oncekit.core.names import KafkaTransactionalId
from oncekit.core.bases import TaskCommitSink
from oncekit.core.protocol import TaskInfo
from oncekit.sinks.kafka._batch_marker import BatchMarker
from oncekit.sinks.kafka._common import FORMAT, KafkaSinkBase, SinkProducer
from oncekit.sinks.kafka._markers import READ_S, SETTLE_S
from oncekit.sinks.kafka._records import RecordStream

logger = logging.getLogger(__name__)


class KafkaTransactionalSink(KafkaSinkBase, TaskCommitSink):
    """Each task commits its own transaction with the batch marker."""

    def commit_task(self, task: TaskInfo, batches: Iterator[pa.RecordBatch]) -> int:
        where = f"{FORMAT} sink {self.sink_id} batch {task.batch_id} partition {task.partition_id}"
        records = RecordStream.of(batches, where)
        transactional_id = KafkaTransactionalId(self.sink_id, task.partition_id)
        self.markers.ensure_writer(task.partition_id)

        def attempt(producer: SinkProducer) -> int:
            # The marker is read while the records stream into the transaction: the read needs
            # no input, and Spark delivers the input meanwhile. A read any time after this
            # producer's init_transactions decides right: an attempt that commits later must
            # have fenced this producer, whose commit then fails.
            # A new producer's init_transactions has settled the id: its read may wait longer.
            # A read of its own thread: one left hanging by a failed attempt delays no other.
            marker = begin(f"{where}: marker read", self.markers.latest, task.partition_id, where,
                           READ_S if producer.fresh else SETTLE_S)
            replayed: list[int] = []

            def marker_of(rows: int, checksum: str) -> BatchMarker | None:
                found = marker.result(2 * READ_S + 10)
                if found is not None:
                    found.refuse_newer(task.epoch, where)
                if found is None or found.is_empty:
                    return BatchMarker(task.batch_id, rows, checksum, epoch=task.epoch)
                publish = found.replayed(task.batch_id, rows, checksum, where, task.epoch)
                if publish is None:
                    replayed.append(task.batch_id)
                return publish

            rows = self.publish(producer, records, task.partition_id, task.batch_id, where, marker_of)
            if replayed:
                logger.info("%s txn %s: already committed with the same records; wrote nothing", where,
                            transactional_id)
                return 0
            logger.info("%s txn %s: committed %s records", where, transactional_id, rows)
            return rows

        return self.commit_with_fencing(transactional_id, where, attempt)


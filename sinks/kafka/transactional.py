"""The transactional Kafka sink: each task writes through a producer whose ``transactional.id``
is stable per (sink, partition), so a zombie attempt is fenced, and commits at the end of the
task with its batch marker. A replayed batch finds the marker and writes nothing (the records it
streamed into its transaction are aborted); a checksum that differs exposes a non-deterministic
replay. Output is visible as soon as each task commits."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa

from oncekit.core.errors import NonDeterministicReplayError
from oncekit.core.names import KafkaTransactionalId, MarkerGroup
from oncekit.core.protocol import TaskCommitSink, TaskInfo
from oncekit.sinks.kafka._common import FORMAT, KafkaSinkBase, RecordStream, SinkProducer

logger = logging.getLogger(__name__)


class KafkaTransactionalSink(KafkaSinkBase, TaskCommitSink):
    """Each task commits its own transaction with the batch marker."""

    def commit_task(self, task: TaskInfo, batches: Iterator[pa.RecordBatch]) -> int:
        where = f"{FORMAT} sink {self.sink_id} batch {task.batch_id} partition {task.partition_id}"
        records = RecordStream.of(batches, where)
        transactional_id = KafkaTransactionalId(self.sink_id, task.partition_id)
        group = MarkerGroup(self.sink_id, task.partition_id)

        def attempt(producer: SinkProducer) -> int:
            # The marker is read while the records stream into the transaction: the read needs
            # no input, and Spark delivers the input meanwhile. A read any time after this
            # producer's init_transactions decides right: an attempt that commits later must
            # have fenced this producer, whose commit then fails.
            marker = _MARKER_READS.submit(self.marker, group)
            replayed: list[int] = []

            def first_time(rows: int, checksum: str) -> bool:
                offset, metadata = marker.result()
                if offset <= task.batch_id:
                    return True
                if offset == task.batch_id + 1 and metadata.get("checksum") != checksum:
                    raise NonDeterministicReplayError(
                        f"{where}: the batch is committed with {metadata.get('rows')} records (checksum "
                        f"{metadata.get('checksum')}), but its replay has {rows} (checksum {checksum}); "
                        "the pipeline is not deterministic, so exactly-once cannot hold"
                    )
                replayed.append(offset)
                return False

            rows = self.publish(producer, records, group, task.batch_id, where, first_time)
            if replayed:
                logger.info("%s txn %s: already committed (marker %s); wrote nothing", where, transactional_id, replayed[0])
                return 0
            logger.info("%s txn %s: committed %s records", where, transactional_id, rows)
            return rows

        return self.commit_with_fencing(transactional_id, where, attempt)


# Marker reads of this process's tasks, beside their records (threads start on first use, so a
# forking Python worker daemon holds none).
_MARKER_READS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="oncekit-marker-read")

"""The transactional Kafka sink: each task writes through a producer whose ``transactional.id``
is stable per (sink, partition), so a zombie attempt is fenced, and commits at the end of the
task with its batch marker. A replayed batch finds the marker and writes nothing; a checksum that
differs exposes a non-deterministic replay. Output is visible as soon as each task commits."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pyarrow as pa
from confluent_kafka import Producer

from oncekit.core.errors import NonDeterministicReplayError
from oncekit.core.names import KafkaTransactionalId, MarkerGroup
from oncekit.core.protocol import TaskCommitSink, TaskInfo
from oncekit.sinks.kafka._common import FORMAT, KafkaSinkBase, RecordStream

logger = logging.getLogger(__name__)


class KafkaTransactionalSink(KafkaSinkBase, TaskCommitSink):
    """Each task commits its own transaction with the batch marker."""

    def commit_task(self, task: TaskInfo, batches: Iterator[pa.RecordBatch]) -> int:
        where = f"{FORMAT} sink {self.sink_id} batch {task.batch_id} partition {task.partition_id}"
        records = RecordStream.of(batches, where)
        transactional_id = KafkaTransactionalId(self.sink_id, task.partition_id)
        group = MarkerGroup(self.sink_id, task.partition_id)

        def attempt(producer: Producer) -> int:
            # Read before the input arrives: a replayed batch's records are only checksummed.
            offset, metadata = self.marker(group)
            if offset > task.batch_id:
                rows, replayed = records.checksum()
                if offset == task.batch_id + 1 and metadata.get("checksum") != replayed:
                    raise NonDeterministicReplayError(
                        f"{where}: the batch is committed with {metadata.get('rows')} records (checksum "
                        f"{metadata.get('checksum')}), but its replay has {rows} (checksum {replayed}); "
                        "the pipeline is not deterministic, so exactly-once cannot hold"
                    )
                logger.info("%s txn %s: already committed (marker %s); writing nothing", where, transactional_id, offset)
                return 0
            rows = self.publish(producer, records, group, task.batch_id, where)
            logger.info("%s txn %s: committed %s records", where, transactional_id, rows)
            return rows

        return self.commit_with_fencing(transactional_id, where, attempt)

"""A savepoint moves: taken while a write-ahead-log batch is journaled and staged but not yet
published (the process died after Spark logged the batch, before the checkpoint-complete
commit), copied to another root through pyarrow's filesystems, the original checkpoint and
savepoint deleted, restored from there into a third root; the restored query publishes the
batch and the output holds every input record exactly once."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from pyarrow.fs import LocalFileSystem, copy_files

from oncekit.connectors import KafkaConfig
from oncekit.connectors.kafka_admin import create_topic
from oncekit.core import savepoint as savepoints
from oncekit.core.crash import arm, fired
from oncekit.core.journal import Journal
from oncekit.core.protocol import SinkConfig
from oncekit.core.staging import StagedFiles
from oncekit.sinks.kafka import kafka_sink
from oncekit.sinks.postgres import postgres_sink
from oncekit.verify import compare
from tests.eos.pipeline import COUNT, PER_BATCH, integers, produce_input, read_committed, run_available_now, table_ids

pytestmark = [pytest.mark.services, pytest.mark.spark]


def wal_sink(target: str, kafka: KafkaConfig, dsn: str, name: str) -> tuple[SinkConfig, Any]:
    """The write-ahead-log sink into ``target`` and a reader of its output's ids."""
    if target == "postgres":
        import psycopg

        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f"CREATE TABLE {name} (id int NOT NULL, payload text NOT NULL)")
        return postgres_sink(dsn, name, "write-ahead-log"), lambda: table_ids(dsn, name)
    topic = name.replace("_", "-") + "-out"
    create_topic(kafka, topic, partitions=2)
    return (kafka_sink(kafka.bootstrap_servers, topic, "write-ahead-log"),
            lambda: [int(v) for v in read_committed(kafka, topic, COUNT, timeout_s=60)])


@pytest.mark.parametrize("target", ["postgres", "kafka"])
def test_savepoint_with_unpublished_wal_batch_copied_across_roots_restores_exactly_once(
    spark: Any, kafka: KafkaConfig, postgres_dsn: str, topic: str, unique_name: str, tmp_path: Path,
    crash_dir: Path, target: str,
) -> None:
    expected = produce_input(kafka, topic, COUNT)
    sink, output = wal_sink(target, kafka, postgres_dsn, unique_name)
    queries = {"q": {"sink_id": sink.sink_id, "fingerprint": "same"}}
    original = tmp_path / "original"

    def frame() -> Any:
        columns = ("id", "CAST(id AS STRING) AS payload") if target == "postgres" else (
            "CAST(id AS STRING) AS key", "CAST(id AS STRING) AS value")
        return integers(spark, kafka, topic, PER_BATCH).selectExpr(*columns)

    arm(crash_dir, "before_notify", batch_id=1)
    with pytest.raises(Exception):
        run_available_now(frame(), sink, str(original / "q"))
    assert fired(crash_dir) == ["before_notify"]
    journaled, done = Journal(str(original / "q"), sink.sink_id).entries()
    assert 1 in journaled - done  # Spark logged batch 1; its rows are staged, not published
    assert [c.batch_id for c in StagedFiles(str(original / "q"), sink.sink_id).leftovers([1])]

    saved = savepoints.create(original, tmp_path / "first-root", "unpublished", queries)
    second_root = f"file://{tmp_path / 'second-root'}"  # another root, reached as a URI
    LocalFileSystem().create_dir(str(tmp_path / "second-root" / "unpublished"))
    copy_files(saved.path, f"{tmp_path / 'second-root'}/unpublished", source_filesystem=LocalFileSystem())
    savepoints.delete(saved.path)
    shutil.rmtree(original)  # nothing restored may point back at the original location

    restored = tmp_path / "restored"
    savepoints.restore(f"{second_root}/unpublished", f"file://{restored}", queries)
    for entry in (restored / "q" / "oncekit").rglob("*.json"):
        assert str(tmp_path) not in entry.read_text(), entry  # journal paths are relative
        assert json.loads(entry.read_text())["sink_id"] == sink.sink_id
    run_available_now(frame(), sink, str(restored / "q"))

    verdict = compare(expected, output())
    assert verdict.exactly_once, verdict.summary()

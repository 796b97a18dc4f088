"""The end-of-input check fails closed: a sink that commits in its tasks (transactional Kafka)
is refused at start where pyspark's worker is not what the check reads, and a task that cannot
see the worker's socket commits nothing; the other protocols need no check."""

from __future__ import annotations

import pytest

from oncekit.core.errors import ConfigError
from oncekit.core.spark import writer


def test_this_pyspark_is_checkable() -> None:
    assert writer.end_of_input_checkable() is None
    writer.refuse_unchecked_input("s", True, "4.3.0")


def test_lookup_that_misses_refuses_task_commit_sink_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(writer, "_WORKER_MAIN", "vendor/worker.py")
    assert writer.end_of_input_checkable() == "pyspark.worker.main has no local 'infile'"
    with pytest.raises(ConfigError, match=r"sink s: this pyspark \(4.3.0\) is not one.*use the write-ahead-log protocol"):
        writer.refuse_unchecked_input("s", True, "4.3.0")
    writer.refuse_unchecked_input("s", False, "4.3.0")  # two-phase commit, write-ahead log: safe without it


def test_task_that_cannot_see_the_socket_commits_nothing() -> None:
    with pytest.raises(ConfigError, match="sink s batch 1 partition 0: cannot see pyspark's worker socket"):
        writer._spark_sent_end_of_stream("sink s batch 1 partition 0", required=True)
    assert writer._spark_sent_end_of_stream("sink s batch 1 partition 0", required=False)

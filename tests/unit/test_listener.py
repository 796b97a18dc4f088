"""The checkpoint listener hears Spark's events of every run of every query in the session, and
delivers each only to the run it watches (issue 33 item 5): a restarted query keeps its query id
and gets a new run id, and a late event of the failed run must not reach, or end, the new one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from oncekit.core.engine import CheckpointEngine
from oncekit.core.spark.listener import CheckpointListener


class _Id:
    def __init__(self, text: str) -> None:
        self.text = text

    def toString(self) -> str:  # noqa: N802 - py4j's java.util.UUID
        return self.text


class _Progress:
    def __init__(self, query_id: str, run_id: str, batch: int) -> None:
        self.ids, self.batch = (_Id(query_id), _Id(run_id)), batch

    def id(self) -> _Id:
        return self.ids[0]

    def runId(self) -> _Id:  # noqa: N802
        return self.ids[1]

    def batchId(self) -> int:  # noqa: N802
        return self.batch


class _Event:
    """A QueryProgressEvent, QueryIdleEvent or QueryTerminatedEvent as py4j shows it."""

    def __init__(self, query_id: str, run_id: str, batch: int = -1) -> None:
        self._progress = _Progress(query_id, run_id, batch)

    def progress(self) -> _Progress:
        return self._progress

    def id(self) -> _Id:
        return self._progress.id()

    def runId(self) -> _Id:  # noqa: N802
        return self._progress.runId()


def test_a_late_event_of_a_failed_run_neither_reaches_nor_ends_the_restarted_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    delivered: list[tuple[str, int | None]] = []

    looked_up: list[str] = []

    class Recorder:
        epoch = 7

        def __init__(self, checkpoint: str) -> None:
            self.checkpoint = checkpoint

        def complete(self, up_to: int | None = None) -> list[int]:
            delivered.append((self.checkpoint, up_to))
            return []

    def for_run(cls: Any, config: Any, checkpoint: str, token: str) -> Recorder:
        looked_up.append(checkpoint)
        return Recorder(checkpoint)

    monkeypatch.setattr(CheckpointEngine, "for_run", classmethod(for_run))
    monkeypatch.setattr(CheckpointEngine, "of", classmethod(lambda cls, config, checkpoint, epoch: Recorder(checkpoint)))
    config: Any = type("Config", (), {"sink_id": "s"})()
    listener = CheckpointListener()
    listener.watch("run-1", config, "first-run")
    listener.onQueryProgress(_Event("query", "run-1", 3))
    listener.watch("run-2", config, "restarted")  # the query failed and started again
    listener.onQueryTerminated(_Event("query", "run-1"))  # late: the failed run's termination
    listener.onQueryProgress(_Event("query", "run-1", 4))  # late: a progress event of the failed run
    listener.onQueryProgress(_Event("query", "run-2", 5))
    listener.onQueryIdle(_Event("query", "run-2"))
    assert delivered == [("first-run", 3), ("first-run", None), ("restarted", 5), ("restarted", None)]
    assert listener.terminated("run-1") and not listener.terminated("run-2")
    assert looked_up == ["first-run", "restarted"]  # a run's epoch is looked up once, not at every event

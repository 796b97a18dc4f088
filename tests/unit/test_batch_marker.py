"""A Kafka writer's batch marker remembers the batches before its latest, so a replay from an
older checkpoint is compared with what was published (issue 21 item 9)."""

from __future__ import annotations

import pytest

from oncekit.core.errors import NonDeterministicReplayError, ReplayError
from oncekit.sinks.kafka._batch_marker import HISTORY, BatchMarker


def published(upto: int) -> BatchMarker:
    marker = BatchMarker(0, 10, "c0")
    for batch in range(1, upto + 1):
        marker = marker.then(batch, 10, f"c{batch}")
    return marker


def test_history_round_trips_and_is_bounded() -> None:
    marker = published(HISTORY + 50)
    assert BatchMarker.from_bytes(marker.to_bytes()) == marker
    assert len(marker.earlier) == HISTORY and marker.earlier[0] == (HISTORY + 49, 10, f"c{HISTORY + 49}")
    assert BatchMarker.from_bytes(b'{"batch": 3, "rows": 1, "checksum": "x"}') == BatchMarker(3, 1, "x")  # before the history


def test_a_new_batch_is_published_after_the_latest() -> None:
    assert published(5).replayed(6, 3, "n", "w") == published(5).then(6, 3, "n")


def test_an_older_batch_with_the_same_records_writes_nothing_and_other_records_are_refused() -> None:
    marker = published(5)
    assert marker.replayed(5, 10, "c5", "w") is None
    assert marker.replayed(2, 10, "c2", "w") is None
    with pytest.raises(NonDeterministicReplayError, match="w: the batch is committed with 10 records"):
        marker.replayed(2, 10, "other", "w")


def test_a_batch_older_than_the_history_is_refused_naming_the_way_out() -> None:
    marker = published(HISTORY + 50)
    with pytest.raises(ReplayError, match="w: the checkpoint replays batch 3, .* Restore a savepoint taken after batch 49"):
        marker.replayed(3, 10, "c3", "w")


def test_a_batch_the_writer_never_had_goes_into_the_history_behind_the_latest() -> None:
    marker = BatchMarker(1, 10, "c1").then(4, 10, "c4")
    kept = marker.replayed(2, 7, "c2", "w")
    assert kept is not None and kept.batch_id == 4 and (2, 7, "c2") in kept.earlier
    assert kept.replayed(2, 7, "c2", "w") is None

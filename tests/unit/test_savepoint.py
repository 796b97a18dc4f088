"""Savepoint files without Spark: what is copied, what is refused, list and delete."""

from __future__ import annotations

from pathlib import Path

import pytest

from oncekit.core.savepoint import SavepointError, create, delete, list_savepoints, load, restore

QUERIES = {"balances": {"sink_id": "balances", "fingerprint": "aaaa"},
           "late_events": {"sink_id": "late-events", "fingerprint": "bbbb"}}


OFFSET_LOG = 'v1\n{"batchWatermarkMs":0,"conf":{"spark.sql.shuffle.partitions":"3"}}\n{"payments":{"0":10}}'


def fake_checkpoint(root: Path) -> Path:
    """Two queries; balances committed batches 0 and 1 and planned 2 (journaled, not committed)."""
    for query in QUERIES:
        for folder, batches in (("offsets", (0, 1, 2)), ("commits", (0, 1))):
            (root / query / folder).mkdir(parents=True)
            for batch in batches:
                (root / query / folder / str(batch)).write_text(OFFSET_LOG if folder == "offsets" else "v1")
        journal = root / query / "oncekit" / QUERIES[query]["sink_id"] / "journal"
        journal.mkdir(parents=True)
        for name in ("1.json", "1.done", "2.json"):
            (journal / name).write_text("[]")
        (root / query / "state" / "0").mkdir(parents=True)
    return root


def test_savepoint_create_copies_checkpoints_without_uncommitted_journal(tmp_path: Path) -> None:
    saved = create(fake_checkpoint(tmp_path / "cp"), tmp_path / "sp", "first", QUERIES)
    assert {q.name: q.batch_id for q in saved.queries} == {"balances": 1, "late_events": 1}
    assert {q.state_partitions for q in saved.queries} == {3}
    journal = Path(saved.path) / "balances" / "oncekit" / "balances" / "journal"
    assert sorted(p.name for p in journal.iterdir()) == ["1.done", "1.json"]
    assert (Path(saved.path) / "balances" / "offsets" / "2").exists()  # re-run on restore, like a restart
    assert load(saved.path).queries == saved.queries and "pyspark" in saved.versions
    assert [s.name for s in list_savepoints(tmp_path / "sp")] == ["first"]
    with pytest.raises(SavepointError, match="already exists"):
        create(tmp_path / "cp", tmp_path / "sp", "first", QUERIES)


def test_savepoint_restore_into_new_location_then_delete(tmp_path: Path) -> None:
    saved = create(fake_checkpoint(tmp_path / "cp"), tmp_path / "sp", "first", QUERIES)
    restore(saved.path, tmp_path / "new", QUERIES)
    assert (tmp_path / "new" / "late_events" / "commits" / "1").exists()
    with pytest.raises(SavepointError, match="not empty"):
        restore(saved.path, tmp_path / "new", QUERIES)
    delete(saved.path)
    assert list_savepoints(tmp_path / "sp") == []


@pytest.mark.parametrize(("changed", "message"), [
    ({**QUERIES, "balances": {"sink_id": "balances", "fingerprint": "cccc"}}, "operators, sink or output schema changed"),
    ({**QUERIES, "balances": {"sink_id": "balances-v2", "fingerprint": "aaaa"}}, "sink id 'balances' in the savepoint"),
    ({"balances": QUERIES["balances"]}, "queries differ"),
])
def test_savepoint_restore_mismatch_is_refused(tmp_path: Path, changed: dict[str, dict[str, str]], message: str) -> None:
    saved = create(fake_checkpoint(tmp_path / "cp"), tmp_path / "sp", "first", QUERIES)
    with pytest.raises(SavepointError, match=message):
        restore(saved.path, tmp_path / "new", changed)
    assert not (tmp_path / "new").exists()


def test_savepoint_of_a_pipeline_that_never_ran_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SavepointError, match="no checkpoint"):
        create(tmp_path / "nothing", tmp_path / "sp", "first", QUERIES)


def test_savepoint_copied_to_another_root_restores_with_journal_and_staged_files(tmp_path: Path) -> None:
    from pyarrow.fs import LocalFileSystem, copy_files

    checkpoint = fake_checkpoint(tmp_path / "cp")
    staged = checkpoint / "balances" / "oncekit" / "balances" / "staged" / "1"
    staged.mkdir(parents=True)
    (staged / "0-7.arrow").write_bytes(b"rows")
    saved = create(checkpoint, tmp_path / "a", "moved", QUERIES)
    LocalFileSystem().create_dir(str(tmp_path / "b" / "moved"))
    copy_files(saved.path, str(tmp_path / "b" / "moved"))
    delete(saved.path)

    restored = restore(f"file://{tmp_path / 'b' / 'moved'}", f"file://{tmp_path / 'new'}", QUERIES)
    assert restored.path == f"file://{tmp_path / 'b' / 'moved'}"
    sink = tmp_path / "new" / "balances" / "oncekit" / "balances"
    assert (sink / "staged" / "1" / "0-7.arrow").read_bytes() == b"rows"
    assert sorted(p.name for p in (sink / "journal").iterdir()) == ["1.done", "1.json"]
    assert [s.name for s in list_savepoints(f"file://{tmp_path / 'b'}")] == ["moved"]


class _Refusing:
    """A session whose checkpoint manager refuses as Spark does for an operator it cannot rescale."""

    class _streamingCheckpointManager:  # noqa: N801  (Spark's attribute name)
        @staticmethod
        def repartition(location: str, partitions: int) -> None:
            # as PySpark 4.3 raised it for a streaming limit: the refusal is the cause of a schema read error
            refusal = RuntimeError("[STATE_REPARTITION_INVALID_CHECKPOINT.UNSUPPORTED_STATEFUL_OPERATOR] The provided "
                                   "checkpoint location '' is in an invalid state. Unsupported stateful operator "
                                   "globalLimit. Please use a checkpoint with supported stateful operators.")
            raise RuntimeError("[STDS_FAILED_TO_READ_STATE_SCHEMA] Failed to read the state schema.") from refusal


def test_state_rescale_refused_by_spark_names_query_operator_and_what_to_do(tmp_path: Path) -> None:
    from oncekit.core.errors import StateRescaleError
    from oncekit.core.spark.state import repartition_state

    checkpoint = fake_checkpoint(tmp_path / "cp") / "balances"
    assert repartition_state(_Refusing(), str(checkpoint), 3, "balances") is False  # type: ignore[arg-type]
    with pytest.raises(StateRescaleError, match=r"query balances: .* from 3 to 4 partitions: UNSUPPORTED_STATEFUL_OPERATOR "
                                                r"\(operator globalLimit\); .*restore without state partitions"):
        repartition_state(_Refusing(), str(checkpoint), 4, "balances")  # type: ignore[arg-type]


def test_state_rescale_of_a_query_without_state_is_nothing_to_do(tmp_path: Path) -> None:
    """A stateless query (no ``state/``) is not handed to Spark's repartitioning, which refuses it
    (MISSING_OPERATOR_METADATA): restoring a stateless job with --state-partitions just works."""
    import shutil

    from oncekit.core.spark.state import repartition_state

    checkpoint = fake_checkpoint(tmp_path / "cp") / "balances"
    shutil.rmtree(checkpoint / "state")
    assert repartition_state(_Refusing(), str(checkpoint), 4, "balances") is False  # type: ignore[arg-type]


def test_stop_with_savepoint_request_through_the_checkpoint_storage_is_answered_by_the_runner(tmp_path: Path) -> None:
    """The requester sees the job running from the lease of one of its queries (whatever host
    its driver is on) and leaves the request in the checkpoint root; the runner, polling its
    queries' root, takes the savepoint and removes the request."""
    import json
    import threading
    import time

    from oncekit.core.savepoint_stop import StopRequests, request_savepoint, running_queries

    checkpoint = fake_checkpoint(tmp_path / "cp")
    into = f"file://{tmp_path / 'sp'}"
    assert request_savepoint(str(checkpoint), into, "idle", timeout_s=1) is None  # nobody runs there
    lease = checkpoint / "balances" / "oncekit" / "lease"
    lease.write_text(json.dumps({"host": "another-host", "pid": 7, "process": "x", "renewed_at": time.time()}))
    assert running_queries(str(checkpoint)) == ["balances"]
    requests = StopRequests([f"file://{checkpoint}"])
    assert not requests.pending()

    def runner() -> None:  # what 'oncekit run' does between batches, on the driver's host
        while not requests.pending():
            threading.Event().wait(0.05)
        wanted = requests.take()
        assert wanted is not None
        lease.unlink()  # the driver stopped its queries
        create(wanted.root, wanted.into, wanted.name, QUERIES)
        requests.answered(wanted)

    thread = threading.Thread(target=runner)
    thread.start()
    saved = request_savepoint(str(checkpoint), into, "asked", timeout_s=30, poll_s=0.05)
    thread.join()
    assert saved is not None and saved.path == f"{into}/asked"
    assert not requests.pending()


def test_stop_with_savepoint_request_nobody_answers_is_withdrawn_with_a_named_error(tmp_path: Path) -> None:
    import json
    import time

    from oncekit.core.savepoint_stop import REQUEST, StopRequests, request_savepoint

    checkpoint = fake_checkpoint(tmp_path / "cp")
    (checkpoint / "late_events" / "oncekit" / "lease").write_text(
        json.dumps({"host": "another-host", "pid": 7, "process": "x", "renewed_at": time.time()}))
    with pytest.raises(SavepointError, match=r"the driver running late_events from .*cp did not take savepoint "
                                             r"late within 0.2 s"):
        request_savepoint(str(checkpoint), str(tmp_path / "sp"), "late", timeout_s=0.2, poll_s=0.05)
    assert not (checkpoint / REQUEST).exists()
    # A requester killed before it could withdraw: the runner ignores its request once it expired.
    (checkpoint / REQUEST).write_text(json.dumps({"into": str(tmp_path / "sp"), "name": "x", "until": time.time() - 1}))
    assert StopRequests(str(checkpoint)).take() is None and not (checkpoint / REQUEST).exists()


def test_any_jobs_queries_are_found_and_identified_from_their_checkpoints(tmp_path: Path) -> None:
    from oncekit.core.savepoint import identify, queries_under

    root = fake_checkpoint(tmp_path / "cp")
    (root / "balances" / "oncekit" / "plan").write_text("f" * 64)
    (root / "not-a-query").mkdir()
    assert queries_under(str(root)) == ["balances", "late_events"]
    assert identify(str(root / "balances")) == {"sink_id": "balances", "fingerprint": "plan:" + "f" * 64}
    assert identify(str(root / "late_events")) == {"sink_id": "late-events", "fingerprint": "plan:"}
    with pytest.raises(SavepointError, match=r"not-a-query: no oncekit journal: a savepoint takes queries started "
                                             r"with oncekit.start_query"):
        identify(str(root / "not-a-query"))


def test_savepoint_of_a_query_another_driver_runs_is_refused_and_the_lease_is_not_copied(tmp_path: Path) -> None:
    import json
    import time

    root = fake_checkpoint(tmp_path / "cp")
    lease = root / "balances" / "oncekit" / "lease"
    lease.write_text(json.dumps({"host": "other-host", "pid": 7, "process": "x", "renewed_at": time.time()}))
    with pytest.raises(SavepointError, match=r"query balances is running \(driver pid 7 on other-host"):
        create(root, tmp_path / "sp", "live", QUERIES)
    lease.write_text(json.dumps({"host": "other-host", "pid": 7, "process": "x", "renewed_at": time.time() - 600}))
    saved = create(root, tmp_path / "sp", "stopped", QUERIES)  # a lapsed lease: its driver is gone
    assert not (Path(saved.path) / "balances" / "oncekit" / "lease").exists()


def test_restore_says_per_protocol_what_happens_to_batches_written_after_the_savepoint(tmp_path: Path) -> None:
    from oncekit.core.fanout import fan_out
    from oncekit.core.savepoint import replay_notes
    from oncekit.sinks.kafka import kafka_sink
    from oncekit.sinks.postgres import postgres_sink

    saved = create(fake_checkpoint(tmp_path / "cp"), tmp_path / "sp", "first", QUERIES)
    sink = fan_out({"table": postgres_sink("postgresql://h/db", "t", "two-phase-commit"),
                    "topic": kafka_sink("h:9092", "out", "transactional")})
    notes = replay_notes(saved, {"balances": sink})
    assert notes[0] == "query balances resumes after batch 1; batches its sinks wrote after the savepoint are:"
    assert any(n.startswith("  pg-t (two-phase-commit): not written again while the marker table") for n in notes)
    assert any(n.startswith("  kafka-out (transactional): compared with the markers' history") for n in notes)


def test_the_commands_keep_a_jobs_savepoints_under_its_checkpoint_root(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """``oncekit savepoint create`` of a stopped job puts the savepoint in ROOT/_savepoints, where
    list, restore (into --into) and delete find it from the same root; the folder is not taken
    for a query; list with neither a root nor --dir is refused."""
    from oncekit import cli
    from oncekit.core.savepoint import queries_under

    root, new_root = fake_checkpoint(tmp_path / "cp"), tmp_path / "cp2"
    assert cli.main(["savepoint", "create", "s1", "--checkpoint-root", str(root)]) == 0
    assert (root / "_savepoints" / "s1").is_dir() and queries_under(str(root)) == ["balances", "late_events"]
    assert cli.main(["savepoint", "list", "--checkpoint-root", str(root)]) == 0
    assert "s1" in capsys.readouterr().out
    assert cli.main(["savepoint", "restore", "s1", "--checkpoint-root", str(root), "--into", str(new_root)]) == 0
    assert sorted(p.name for p in new_root.iterdir()) == ["balances", "late_events"]
    assert cli.main(["savepoint", "delete", "s1", "--checkpoint-root", str(root)]) == 0
    assert not (root / "_savepoints" / "s1").exists()
    assert cli.main(["savepoint", "list"]) == 1
    assert "give --checkpoint-root" in capsys.readouterr().err

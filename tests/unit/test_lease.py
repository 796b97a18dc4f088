"""The query lease in checkpoint storage (issue 21 item 9): who runs a query, seen from any host."""

from __future__ import annotations

import json
import os
import re
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from oncekit.core.engine import owner_in_use
from oncekit.core.errors import CommitError, ConfigError, LeaseLostError
from oncekit.core.lease import (
    _BOOT,
    EXPIRES_S,
    EXPIRY_ENV,
    LEASE,
    LeaseKeeper,
    QueryLease,
    _expiry_s,
    release_idle,
    require_held,
    wait_free,
)
from oncekit.core.protocol import SinkOwner


def eventually(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Wait until ``condition()`` (a keeper's thread acted), failing after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the keeper did not act within 10 s"
        time.sleep(0.02)


def _write(checkpoint: Path, **lease: object) -> None:
    """Another driver's lease, written as drivers write it: whole, by a rename (a keeper renewing
    meanwhile must never read it half-written, take that for no lease and overwrite it)."""
    (checkpoint / LEASE).parent.mkdir(parents=True, exist_ok=True)
    (checkpoint / f"{LEASE}.tmp").write_text(json.dumps(lease))
    (checkpoint / f"{LEASE}.tmp").replace(checkpoint / LEASE)


def test_taken_renewed_and_released_by_this_process(tmp_path: Path) -> None:
    lease = QueryLease(str(tmp_path))
    assert lease.holder() is None
    lease.renew("run-1")
    held = lease.holder()
    assert held is not None and held.is_mine and held.pid == os.getpid() and held.run == "run-1"
    lease.release()
    assert lease.holder() is None


def test_another_hosts_lease_holds_until_it_expires(tmp_path: Path) -> None:
    _write(tmp_path, host="other-host", pid=1, process="x", renewed_at=time.time() - 5)
    held = QueryLease(str(tmp_path)).holder()
    assert held is not None and not held.is_mine and "on other-host" in held.describe()
    QueryLease(str(tmp_path)).release()  # not ours: kept
    assert QueryLease(str(tmp_path)).holder() is not None
    _write(tmp_path, host="other-host", pid=1, process="x", renewed_at=time.time() - EXPIRES_S - 1)
    assert QueryLease(str(tmp_path)).holder() is None


def test_a_dead_process_on_this_host_holds_nothing(tmp_path: Path) -> None:
    dead = 2**22 + 12345  # above pid_max's default: no such process
    _write(tmp_path, host=socket.gethostname(), pid=dead, process="x", renewed_at=time.time(), boot=_BOOT)
    assert QueryLease(str(tmp_path)).holder() is None


def test_a_pid_of_another_boot_or_pid_namespace_is_not_looked_up_here(tmp_path: Path) -> None:
    """Containers that share the host's name (host networking) and cloned machines have the same
    host name and their own pids: a pid missing here says nothing about the process there."""
    dead = 2**22 + 12345
    for boot in ("", "another-boot/pid:[4026531836]", _BOOT.split("/")[0] + "/pid:[1]"):
        _write(tmp_path, host=socket.gethostname(), pid=dead, process="x", renewed_at=time.time(), boot=boot)
        assert QueryLease(str(tmp_path)).holder() is not None, boot


def test_a_keeper_renews_until_released_and_never_overwrites_another_drivers_lease(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("oncekit.core.lease.RENEW_S", 0.05)
    kept = LeaseKeeper(str(tmp_path))
    kept.hold("run-1")
    first = QueryLease(str(tmp_path)).recorded()
    assert first is not None
    # The keeper's thread renews every 0.05 s; on a loaded machine it may be late, so each check
    # waits for its condition (at most 10 s) instead of sleeping a fixed time.
    eventually(lambda: (renewed := QueryLease(str(tmp_path)).recorded()) is not None
               and renewed.renewed_at > first.renewed_at and renewed.is_mine)
    kept.idle()  # the query failed: the lease is kept for its restart
    time.sleep(0.2)
    assert QueryLease(str(tmp_path)).holder() is not None
    kept.hold("run-2")  # restarted in place
    assert QueryLease(str(tmp_path)).recorded().run == "run-2"  # type: ignore[union-attr]
    # Another driver writes between two renewals (under the keeper's lock): a write landing between a
    # renewal's read and its write is overwritten, which the lease allows (it only decides who runs;
    # the targets' epochs fence what is written, and a standby puts its higher epoch's record back).
    with kept._lock:
        _write(tmp_path, host="other-host", pid=1, process="x", renewed_at=time.time() - 3 * EXPIRES_S, run="standby")
    eventually(lambda: kept.taken_by() is not None)
    assert "other-host" in kept.taken_by()  # type: ignore[operator]
    assert QueryLease(str(tmp_path)).recorded().run == "standby"  # type: ignore[union-attr]  # not overwritten
    kept.release()
    assert QueryLease(str(tmp_path)).recorded().run == "standby"  # type: ignore[union-attr]  # not ours to delete
    with pytest.raises(ConfigError, match="is running"):
        _write(tmp_path, host="other-host", pid=1, process="x", renewed_at=time.time(), run="standby")
        kept.hold("run-3")


def test_release_idle_gives_up_the_leases_of_queries_that_failed_for_good(tmp_path: Path) -> None:
    from oncekit.core.lease import keeper

    running, failed = keeper(str(tmp_path / "running")), keeper(str(tmp_path / "failed"))
    running.hold("a")
    failed.hold("b")
    failed.idle()
    release_idle()
    assert QueryLease(str(tmp_path / "running")).holder() is not None
    assert QueryLease(str(tmp_path / "failed")).holder() is None
    running.release()
    assert QueryLease(str(tmp_path / "running")).holder() is None


def test_release_idle_takes_only_the_keepers_it_is_told(tmp_path: Path) -> None:
    from oncekit.core.lease import keeper

    same, other = keeper(str(tmp_path / "same")), keeper(str(tmp_path / "other"))
    same.query_id, other.query_id = "q1", "q2"
    for kept in (same, other):
        kept.hold("r")
        kept.idle()
    release_idle(lambda kept: kept.query_id == "q1")  # start_query of q1 from another checkpoint
    assert QueryLease(str(tmp_path / "same")).holder() is None
    assert QueryLease(str(tmp_path / "other")).holder() is not None
    other.release()


def test_a_restored_savepoint_is_refused_while_its_original_runs(tmp_path: Path) -> None:
    original, restored = tmp_path / "original", tmp_path / "restored"
    _write(original, host="other-host", pid=1, process="x", renewed_at=time.time())
    reason = owner_in_use(SinkOwner("q1", str(original)), SinkOwner("q1", str(restored)))
    assert reason is not None and "runs from" in reason and "other-host" in reason
    (original / LEASE).unlink()
    assert owner_in_use(SinkOwner("q1", str(original)), SinkOwner("q1", str(restored))) is None


def test_a_driver_whose_lease_another_run_took_journals_nothing(tmp_path: Path) -> None:
    QueryLease(str(tmp_path)).renew("mine")
    require_held(str(tmp_path), "mine", "sink s batch 3")
    _write(tmp_path, host="other-host", pid=1, process="x", renewed_at=time.time(), run="standby")
    with pytest.raises(CommitError, match=r"sink s batch 3: the query's lease is held by another driver \(driver pid 1 on other-host"):
        require_held(str(tmp_path), "mine", "sink s batch 3")
    (tmp_path / LEASE).unlink()
    require_held(str(tmp_path), "mine", "sink s batch 3")  # lapsed or released: nobody else holds it


def test_a_standby_waits_until_the_lease_is_void(tmp_path: Path) -> None:
    told: list[str] = []
    _write(tmp_path, host="other-host", pid=1, process="x", renewed_at=time.time() - EXPIRES_S + 0.5, run="active")
    started = time.monotonic()
    wait_free([str(tmp_path)], poll_s=0.05, announce=told.append)
    assert 0.3 < time.monotonic() - started < 5 and told and "waiting" in told[0]


def test_a_waiting_standby_warms_up_again_while_it_waits(tmp_path: Path) -> None:
    calls: list[float] = []
    _write(tmp_path, host="other-host", pid=1, process="x", renewed_at=time.time() - EXPIRES_S + 0.5, run="active")
    wait_free([str(tmp_path)], every=(0.1, lambda: calls.append(time.monotonic())))
    assert len(calls) >= 2


def test_the_lease_expiry_comes_from_the_environment_and_a_bad_one_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(EXPIRY_ENV, "20")
    assert _expiry_s() == 20.0
    for bad in ("soon", "0", "2"):
        monkeypatch.setenv(EXPIRY_ENV, bad)
        with pytest.raises(ConfigError, match=f"{EXPIRY_ENV}='{bad}'"):
            _expiry_s()


def test_a_query_that_spark_failed_after_another_driver_took_its_lease_raises_lease_lost(tmp_path: Path) -> None:
    """Found by the standby campaign in a clean-clone run: the active driver, paused past its
    lease's expiry and resumed, had Spark fail its query (CONCURRENT_STREAM_LOG_UPDATE: the
    standby had taken over and written the next batch) before its watchdog looked at the lease.
    The driver then saw Spark's error, not LeaseLostError, and its restart strategy started the
    query again and again, refused each time, for minutes, instead of stopping at once."""
    from oncekit.core.spark.query import OncekitQuery
    from oncekit.core.spark.watchdog import BatchWatchdog

    class FailedBySpark:
        isActive = False

        def awaitTermination(self, timeout: float) -> bool:
            raise RuntimeError("[CONCURRENT_STREAM_LOG_UPDATE] Concurrent update to the log")

        def exception(self) -> None:
            return None

    QueryLease(str(tmp_path)).renew("the-standby's-run")  # the standby took the lease over
    query: Any = FailedBySpark()
    watchdog = BatchWatchdog(query, str(tmp_path), "q", timeout_s=60.0, run="this-driver's-run")
    with pytest.raises(LeaseLostError, match=r"query q: its lease is held by another driver") as raised:
        failed = OncekitQuery(query, sink=None, checkpoint=str(tmp_path), watchdog=watchdog)  # type: ignore[arg-type]
        failed.await_termination()
    assert "CONCURRENT_STREAM_LOG_UPDATE" in str(raised.value.__cause__)


def test_a_deposed_driver_whose_query_will_not_stop_exits_with_a_named_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 36, finding 3: a driver that lost its lease stops its query (bounded); when that
    stop hangs, await_termination must end with QueryStuckError naming the lease, not wait for
    ever on a query that stays active."""
    import threading

    from oncekit.core.errors import QueryStuckError
    from oncekit.core.spark import query as queries
    from oncekit.core.spark import watchdog as watchdogs

    monkeypatch.setattr(watchdogs, "STOP_S", 0.3)
    never = threading.Event()

    class WillNotStop:
        isActive = True

        def awaitTermination(self, timeout: float) -> bool:
            never.wait(timeout)
            return False

        def stop(self) -> None:
            never.wait()

        def exception(self) -> None:
            return None

    query: Any = WillNotStop()
    watchdog = watchdogs.BatchWatchdog(query, str(tmp_path), "q", timeout_s=60.0, run="this-driver's-run")
    watchdog._lost("driver pid 7 on another-host")
    outcome: list[BaseException | None] = []

    def wait() -> None:
        try:
            queries.OncekitQuery(query, sink=None, checkpoint=str(tmp_path), watchdog=watchdog).await_termination()  # type: ignore[arg-type]
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            outcome.append(exc)

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    waiter.join(10)
    never.set()
    assert outcome, "await_termination still waits on a deposed driver's query that will not stop"
    assert isinstance(outcome[0], QueryStuckError), outcome
    assert re.search(r"query q: its lease is held by another driver .* did not stop within 0 s: restart the driver "
                     r"process", str(outcome[0])), outcome[0]


# -- issue 46, findings 3 and 7: the lease follows the epoch, and a standby that loses goes back to waiting


def test_a_keeper_that_saw_another_runs_lease_renews_again_once_the_lease_is_its_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two standbys took the lease at the same moment; this one's record was overwritten by the
    other's hold, then this one's run won (its writer took the higher epoch and recorded the
    lease as this run's). Its keeper must renew the lease from then on, not leave it to lapse."""
    monkeypatch.setattr("oncekit.core.lease.RENEW_S", 0.05)
    kept = LeaseKeeper(str(tmp_path))
    kept.hold("mine")
    with kept._lock:  # between two renewals, as in the test above
        _write(tmp_path, host="other-host", pid=1, process="x", renewed_at=time.time(), run="theirs")
    eventually(lambda: kept.taken_by() is not None)  # the keeper saw the other run's record
    QueryLease(str(tmp_path)).renew("mine")  # this run won: the lease is its run's again
    written = QueryLease(str(tmp_path)).recorded()
    assert written is not None
    eventually(lambda: (renewed := QueryLease(str(tmp_path)).recorded()) is not None and renewed.run == "mine"
               and renewed.renewed_at > written.renewed_at)  # the keeper renews again
    kept.release()


def test_a_failed_warm_up_does_not_end_a_waiting_standby(tmp_path: Path) -> None:
    """A standby's warm-up that fails while it waits (its Spark busy, a worker that died) is
    logged and tried again; the standby keeps waiting and takes over when the lease lapses."""
    _write(tmp_path, host="other-host", pid=1, process="x", renewed_at=time.time() - EXPIRES_S + 0.5, run="active")
    calls: list[float] = []

    def failing_warm_up() -> None:
        calls.append(time.monotonic())
        raise RuntimeError("the warm-up query failed")

    wait_free([str(tmp_path)], every=(0.1, failing_warm_up))
    assert len(calls) >= 2


def test_a_live_driver_on_this_host_is_live_where_proc_hides_other_users_processes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With /proc mounted hidepid=2 a process of another user has no /proc entry, yet it runs:
    its lease must not look void."""
    import subprocess
    import sys

    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        real_exists = os.path.exists
        monkeypatch.setattr(os.path, "exists", lambda path: False if str(path).startswith("/proc/") else real_exists(path))
        _write(tmp_path, host=socket.gethostname(), pid=other.pid, process="x", renewed_at=time.time(), boot=_BOOT,
               run="active")
        assert QueryLease(str(tmp_path)).holder() is not None
    finally:
        other.kill()
        other.wait()


def test_a_query_stopped_with_a_savepoint_keeps_its_standby_waiting_until_a_driver_starts_it_again(
    tmp_path: Path,
) -> None:
    """A job stopped with a savepoint (for an upgrade) stays stopped: its lease says so, in the
    same write that gives it up, and a standby waits on; a driver that starts the query takes the
    lease as from nobody, and the standby takes over once that driver's lease lapses."""
    from oncekit.core.lease import Driver

    checkpoint, told = str(tmp_path), []
    active = LeaseKeeper(checkpoint, Driver("host-a", 1, "driver-a", ""))
    active.hold("run-1")
    active.release(stopped_with="savepoint before-upgrade")
    lease = QueryLease(checkpoint)
    assert lease.holder() is None and lease.recorded() is not None
    assert lease.recorded().stopped_with == "savepoint before-upgrade"  # type: ignore[union-attr]

    def later() -> None:  # the standby's warm-up, every 0.1 s: a driver starts the job again, then dies
        if len(told) == 1 and "stopped with savepoint before-upgrade" in told[0]:
            restarted = LeaseKeeper(checkpoint, Driver("host-b", 2, "driver-b", ""))
            restarted.hold("run-2")  # a start is not refused by a stopped query's record
            restarted._stop.set()  # noqa: SLF001 - its host dies: no more renewals
            _write(tmp_path, host="host-b", pid=2, process="driver-b", run="run-2",
                   renewed_at=time.time() - EXPIRES_S + 0.5)

    started = time.monotonic()
    wait_free([checkpoint], poll_s=0.05, announce=told.append, every=(0.1, later))
    assert len(told) == 2 and "is run by driver pid 2 on host-b" in told[1], told
    assert time.monotonic() - started < 10



def test_a_running_keeper_takes_its_lease_back_from_an_older_drivers_late_stop_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A superseded driver that read its own lease, paused, and then stopped with a savepoint
    writes its stop record over the newer run's lease. The newer run's keeper must put its own
    record back, not stand aside for a run that no longer runs."""
    from oncekit.core.lease import Lease

    monkeypatch.setattr("oncekit.core.lease.RENEW_S", 0.05)
    kept = LeaseKeeper(str(tmp_path))
    kept.hold("newer")
    QueryLease(str(tmp_path)).write(Lease("old-host", 7, "old", time.time(), "older", stopped_with="savepoint s1"))
    eventually(lambda: (found := QueryLease(str(tmp_path)).recorded()) is not None and found.run == "newer")
    assert kept.taken_by() is None
    kept.release()

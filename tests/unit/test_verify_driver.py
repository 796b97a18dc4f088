"""A campaign's driver process: one whose Spark did not start is started once more, as a
supervisor would; any other exit fails the campaign with the end of the driver's log."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from oncekit.core.errors import VerifyError
from oncekit.verify import PipelineContext
from oncekit.verify import driver as driver_module
from oncekit.verify.driver import DriverProcess


def _script(timeline: Path, steps: tuple[str, ...], exit_code: int | None) -> str:
    """A stand-in driver: prints a line, notes ``steps`` in ``timeline``, then exits with
    ``exit_code`` (or waits to be killed)."""
    end = f"sys.exit({exit_code})" if exit_code is not None else "time.sleep(60)"
    return (f"import json, os, sys, time\nprint('a stand-in driver, pid', os.getpid())\n"
            f"for step in {steps!r}:\n"
            f"    open({str(timeline)!r}, 'a').write(json.dumps({{'step': step, 't': time.time(), 'pid': os.getpid()}}) + '\\n')\n"
            f"{end}\n")


@pytest.fixture()
def drivers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[list[str], DriverProcess]:
    """The stand-in scripts to run, one per start, and a standby DriverProcess that runs them."""
    scripts: list[str] = []

    def start(*args: Any, log: Path, **kwargs: Any) -> subprocess.Popen[bytes]:
        with open(log, "ab") as out:
            return subprocess.Popen([sys.executable, "-c", scripts.pop(0)], stdout=out, stderr=out,
                                    start_new_session=True)

    monkeypatch.setattr(driver_module, "start_driver", start)
    ctx = PipelineContext("127.0.0.1:9092", "in", "out", str(tmp_path / "checkpoint"))
    return scripts, DriverProcess("example", ctx, "", tmp_path / "driver.log", {}, standby=True)


def test_a_standby_whose_spark_did_not_start_is_started_once_more(
        tmp_path: Path, drivers: tuple[list[str], DriverProcess]) -> None:
    scripts, standby = drivers
    timeline = tmp_path / "checkpoint.timeline"
    scripts += [_script(timeline, ("process",), 1), _script(timeline, ("process", "session", "warm"), None)]
    standby.ensure_running()
    try:
        standby.wait_step("warm", 30)
        assert standby.restarts == 1
    finally:
        standby.kill()


def test_a_driver_that_exits_after_sparks_start_fails_with_the_end_of_its_log(
        tmp_path: Path, drivers: tuple[list[str], DriverProcess]) -> None:
    scripts, standby = drivers
    scripts += [_script(tmp_path / "checkpoint.timeline", ("process", "session"), 1)]
    standby.ensure_running()
    with pytest.raises(VerifyError, match="did not reach warm.*exit 1.*a stand-in driver, pid"):
        standby.wait_step("warm", 30)
    assert standby.restarts == 0

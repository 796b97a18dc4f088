from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from oncekit.core.crash import CRASH_EXIT_CODE, arm, fired, fired_at, release
from oncekit.core.errors import ConfigError

PROGRAM = "from oncekit.core.crash import crash_point; crash_point('mid_commit', {batch}); print('survived')"


def run(crash_dir: Path | None, batch: int) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin"}
    if crash_dir is not None:
        env["ONCEKIT_CRASH_DIR"] = str(crash_dir)
    return subprocess.run([sys.executable, "-c", PROGRAM.format(batch=batch)], env=env, capture_output=True,
                          text=True, check=False)


def test_crash_point_armed_for_batch_fires_once(tmp_path: Path) -> None:
    arm(tmp_path, "mid_commit", batch_id=3)
    assert run(tmp_path, 2).stdout.strip() == "survived"
    assert run(tmp_path, 3).returncode == CRASH_EXIT_CODE
    assert fired(tmp_path) == ["mid_commit"]
    assert run(tmp_path, 3).stdout.strip() == "survived"


def test_crash_point_unarmed_does_nothing(tmp_path: Path) -> None:
    assert run(None, 3).stdout.strip() == "survived"
    assert run(tmp_path, 3).stdout.strip() == "survived"


def test_arm_unknown_point_is_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown crash point"):
        arm(tmp_path, "nowhere")


def test_crash_point_armed_to_hold_waits_for_release(tmp_path: Path) -> None:
    arm(tmp_path, "mid_commit", batch_id=3, hold=True)
    env = {"PATH": "/usr/bin:/bin", "ONCEKIT_CRASH_DIR": str(tmp_path)}
    held = subprocess.Popen([sys.executable, "-c", PROGRAM.format(batch=3)], env=env, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while fired_at(tmp_path, "mid_commit") in (None, {"batch": None, "partition": None, "pid": None}):
        assert time.monotonic() < deadline and held.poll() is None
        time.sleep(0.05)
    assert fired_at(tmp_path, "mid_commit") == {"batch": 3, "partition": None, "pid": held.pid}
    time.sleep(0.3)
    assert held.poll() is None  # still holding
    release(tmp_path, "mid_commit")
    assert held.communicate(timeout=60)[0].strip() == "survived"
    assert not list(tmp_path.glob("*.release"))

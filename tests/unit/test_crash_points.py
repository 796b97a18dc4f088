from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from oncekit.core.crash import CRASH_EXIT_CODE, arm, fired
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

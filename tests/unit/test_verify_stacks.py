"""A campaign's stall report: the stacks of the driver and of every process under it, also those
in a process group of their own (as pyspark's worker daemon makes)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from oncekit.core.stacks import process_tree
from oncekit.verify.driver import DriverProcess


def test_stacks_cover_the_driver_and_descendants_in_other_process_groups(tmp_path: Path) -> None:
    child = "import os, time; os.setpgid(0, 0); time.sleep(30)"
    parent = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child!r}]); time.sleep(30)"
    process = subprocess.Popen([sys.executable, "-c", parent], start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while len(process_tree(process.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        tree = process_tree(process.pid)
        assert len(tree) == 2 and tree[0] == process.pid
        stacks = DriverProcess("example", None, "", tmp_path / "driver.log", {}, process=process).stacks()  # type: ignore[arg-type]
        assert all(f"--- pid {pid} (" in stacks for pid in tree)
        assert "sleep" in stacks or "<module>" in stacks
    finally:
        subprocess.run(["pkill", "-KILL", "-P", str(process.pid)], check=False)
        process.kill()

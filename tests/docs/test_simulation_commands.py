"""The design page's simulation commands, as a contributor types them (with fewer schedules): a
docs test, kept out of the simulation's own pytest run (tests/sim/test_simulation.py), which
make test times beside the suite."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.docs.console import console_commands


def test_the_design_pages_simulation_commands_run() -> None:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for command in console_commands("simulation-explore", {"--schedules 10000": "--schedules 20",
                                                             ".venv/bin/python": sys.executable}):
        done = subprocess.run(["bash", "-c", command], cwd=root, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"{command}: {done.stdout[-2000:]}{done.stderr[-2000:]}"

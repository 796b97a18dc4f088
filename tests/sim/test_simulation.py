"""Exactly-once under overlapping drivers, checked over many schedules of the simulation
(tests/sim/world.py): per protocol and for a fan-out, ``ONCEKIT_SIM_SCHEDULES`` schedules (600
when pytest runs it alone; make test 10,000 in a pytest run of its own beside the suite; make
test-long 200,000), their seeds drawn from the run's ``ONCEKIT_VERIFY_SEED``. A failing schedule is shrunk
and its trace printed, with the seed that replays it."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.docs.console import console_commands
from tests.sim.explore import explore, outcome, report, shrink
from tests.sim.world import PROTOCOLS, Scenario

SCHEDULES_ENV = "ONCEKIT_SIM_SCHEDULES"
DEFAULT_SCHEDULES = 600
PROCESSES_ENV = "ONCEKIT_SIM_PROCESSES"
"""How many forked processes explore each scenario's schedules (make test's background run: 2)."""


def first_seed(protocol: str) -> int:
    """This run's first seed of ``protocol``: from the run's verify seed, so that setting it
    replays the same schedules."""
    return int(os.environ.get("ONCEKIT_VERIFY_SEED", "1")) * 10_000_000 + PROTOCOLS.index(protocol) * 1_000_000


@pytest.mark.long(60)
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_every_schedule_of_overlapping_drivers_leaves_each_target_exactly_once(
    protocol: str, campaign_tables: list[str],
) -> None:
    schedules = int(os.environ.get(SCHEDULES_ENV, str(DEFAULT_SCHEDULES)))
    scenario = Scenario(protocol)
    started = time.monotonic()
    processes = int(os.environ.get(PROCESSES_ENV, "1"))
    failure = explore(scenario, schedules, first_seed(protocol), processes)
    took = time.monotonic() - started
    campaign_tables.append(f"simulation {protocol}: {schedules} schedules from seed {first_seed(protocol)} in "
                           f"{processes} process(es), {took:.0f} s: "
                           f"{outcome(failure)}")
    if failure:
        pytest.fail(report(scenario, failure, shrink(scenario, failure)), pytrace=False)


def test_the_design_pages_simulation_commands_run() -> None:
    """The design page's two commands, as a contributor types them (fewer schedules)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for command in console_commands("simulation-explore", {"--schedules 10000": "--schedules 20",
                                                             ".venv/bin/python": sys.executable}):
        done = subprocess.run(["bash", "-c", command], cwd=root, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"{command}: {done.stdout[-2000:]}{done.stderr[-2000:]}"

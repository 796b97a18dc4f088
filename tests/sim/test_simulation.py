"""Exactly-once under overlapping drivers, checked over many schedules of the simulation
(tests/sim/world.py): per protocol and for a fan-out, ``ONCEKIT_SIM_SCHEDULES`` schedules (600
when pytest runs it alone; make test 10,000 in a pytest run of its own beside the suite; make
test-long 200,000), their seeds drawn from the run's ``ONCEKIT_VERIFY_SEED``. A failing schedule is shrunk
and its trace printed, with the seed that replays it."""

from __future__ import annotations

import os
import time

import pytest

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


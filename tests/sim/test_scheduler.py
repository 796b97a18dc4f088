"""The simulation's scheduler: a schedule is a function of its choices, and an operation reached
outside the running actor's greenlet (a finalizer the garbage collector runs, say) takes no step
and is reported, rather than silently changing the schedule."""

from __future__ import annotations

import greenlet
import pytest

from tests.sim.explore import run_one
from tests.sim.scheduler import Choices, Process, Scheduler
from tests.sim.world import PROTOCOLS, Scenario


def test_a_seed_and_its_recorded_choices_make_the_same_schedule() -> None:
    for protocol in PROTOCOLS:
        for seed in range(5):
            explored = Choices(seed)
            message, world = run_one(Scenario(protocol), explored)
            replayed = Choices(recorded=list(explored.made))
            again, replay = run_one(Scenario(protocol), replayed)
            assert (again, replay.scheduler.steps, replayed.made) == (message, world.scheduler.steps, explored.made)


def test_an_operation_outside_the_running_actors_greenlet_takes_no_step_and_is_reported() -> None:
    scheduler = Scheduler(Choices(1))
    process = Process("p")
    done: list[str] = []

    def actor() -> None:
        scheduler.step("inside")
        greenlet.greenlet(lambda: scheduler.step("from another greenlet")).switch()
        scheduler.step("inside again")
        done.append("ran")

    scheduler.spawn("a", process, actor)
    assert scheduler.run(100) is True
    scheduler.close()
    assert done == ["ran"]
    assert len(scheduler.strays) == 1 and scheduler.strays[0].startswith("from another greenlet outside a's greenlet")


def test_a_failure_says_whether_it_fails_again_when_replayed_in_its_explorer_process(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.sim import explore, world

    runs = iter([True, False])  # the exploring run fails, its replay passes: a schedule that depends on more

    def check(self: world.World, ended: bool) -> None:
        if next(runs, False):
            raise world.Violation("made up")

    monkeypatch.setattr(world.World, "check", check)
    failure = explore.explore(Scenario("postgres-idempotent"), 1, 7)
    assert failure is not None and failure.seed == 7
    assert failure.message == "made up [replayed at once in its explorer process: PASSES]"
    assert "NOT REPRODUCED" in explore.report(Scenario("postgres-idempotent"), failure, explore.shrink(Scenario("postgres-idempotent"), failure))

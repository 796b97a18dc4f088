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


def test_a_greenlet_ended_by_another_than_the_scheduler_does_not_go_back_to_the_pool() -> None:
    """greenlet ends a suspended greenlet it collects by raising GreenletExit in it: only the
    scheduler's own :class:`~tests.sim.scheduler.Killed` sends a worker back to the pool, else a
    half-ended greenlet could run the next schedule's actor."""
    from tests.sim.scheduler import _Worker

    scheduler = Scheduler(Choices(1))
    actor = scheduler.spawn("a", Process("p"), lambda: [scheduler.step(label) for label in ("1", "2", "3")])
    assert scheduler.run(1) is False  # ended by the step budget, its actor waiting in step "2"
    actor.glet.throw(greenlet.GreenletExit())
    assert actor.glet.dead and all(worker.glet is not actor.glet for worker in _Worker._idle)


def test_two_runs_of_the_same_choices_are_told_apart_at_the_first_step_where_they_part() -> None:
    from types import SimpleNamespace
    from typing import Any

    from tests.sim.explore import parting

    def run(*names: str) -> Any:
        return SimpleNamespace(scheduler=SimpleNamespace(ran=[SimpleNamespace(name=name) for name in names]))

    assert parting(run("a", "b"), run("a", "b")) == ""
    assert parting(run("a", "b", "c", "d", "e"), run("a", "b", "c", "d", "f", "g")) == (
        "; the runs part at step 5: the explored one ran b, c, d, e (of 5 steps), the replay b, c, d, f (of 6)")
    assert parting(run("a", "b"), run("a", "b", "c")) == (
        "; the runs part at step 3: the explored one ran a, b (of 2 steps), the replay a, b, c (of 3)")


def _recursion_left() -> int:
    """How many calls deeper this greenlet may go before RecursionError."""
    calls = 0

    def deeper() -> None:
        nonlocal calls
        calls += 1
        deeper()

    try:
        deeper()
    except RecursionError:
        pass
    return calls


def test_an_actor_starts_as_deep_as_the_scheduler_whoever_first_switches_to_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A greenlet takes the recursion depth of the one that first switches to it. An actor's
    greenlet is reused for later actors (and schedules): started from deep in another actor's
    stack, it would keep that depth, and greenlets started from it deeper still, until plain
    calls of the kit raise RecursionError in a schedule of a long exploration (which made its
    schedules depend on the process's history: issue 46's open finding)."""
    from tests.sim.scheduler import _Worker

    monkeypatch.setattr(_Worker, "_idle", [])  # no greenlets from earlier tests
    scheduler = Scheduler(Choices(1))
    process = Process("p")
    left: list[int] = []

    def spawn_deep(levels: int) -> None:
        if levels:
            spawn_deep(levels - 1)
            return
        scheduler.spawn("child", process, lambda: left.append(_recursion_left()))
        scheduler.sleep(1.0)  # the child is the only one to run: switched to from down here

    scheduler.spawn("parent", process, lambda: spawn_deep(300))
    assert scheduler.run(100) is True
    scheduler.close()
    assert left and left[0] > _recursion_left() - 100, f"{left[0]} calls left in the child, {_recursion_left()} here"


def test_an_error_while_choosing_the_next_step_ends_the_schedule_and_is_reported() -> None:
    """An error of the simulation's own code while an actor's step chooses who goes on (the
    world's faults, a model's wait condition) must not leave that actor running unscheduled: it
    would take no step again, and a restart loop of the kit's around it would spin for ever."""
    scheduler = Scheduler(Choices(1))
    ran: list[int] = []

    def actor() -> None:
        for op in range(1000):
            try:
                scheduler.step(f"op {op}")
            except RecursionError:
                pass  # as a restart loop of the kit's would: go on
            ran.append(op)

    picks = iter(range(10**6))

    def between() -> None:
        if next(picks) == 3:
            raise RecursionError("made up")

    scheduler.spawn("a", Process("p"), actor)
    assert scheduler.run(100, between) is False
    scheduler.close()
    assert len(ran) < 5
    assert len(scheduler.strays) == 1 and scheduler.strays[0].startswith("choosing the step after a's op 3: RecursionError: made up")

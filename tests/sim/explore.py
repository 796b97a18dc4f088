"""Exploring schedules: run many seeds of a scenario, and shrink a failing one to a short trace.

A schedule is its list of choices (:class:`~tests.sim.scheduler.Choices`): a seed gives one, a
recorded list replays it (0 past its end: the plain choice). Shrinking tries shorter and smaller
lists (cut the tail, drop a block, lower a value), keeps any that still fails, and stops when
none does; the trace of what is left is printed step by step.

``python -m tests.sim.explore PROTOCOL [--schedules N] [--seed S] [--processes P] [--replay SEED]``
"""

from __future__ import annotations

import argparse
import gc
import logging
import multiprocessing
import random
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass

from tests.sim.scheduler import Choices
from tests.sim.world import PROTOCOLS, Scenario, Violation, World


@dataclass
class Failure:
    seed: int
    choices: list[int]
    message: str


def run_one(scenario: Scenario, choices: Choices, trace: bool = False) -> tuple[str | None, World]:
    """Run one schedule; its violation's message, or None when every invariant held."""
    world = World(scenario, choices, trace)
    try:
        world.run()
    except Violation as violation:
        return str(violation), world
    return None, world


CHUNK = 100
"""Seeds a forked explorer runs at a time (a few tenths of a second): small enough that the
processes end together, large enough that handing them out costs nothing beside them."""


def explore(scenario: Scenario, schedules: int, first_seed: int, processes: int = 1) -> Failure | None:
    """Run ``schedules`` seeds from ``first_seed``; the first failure, or None. With
    ``processes`` > 1 the seeds run in chunks of :data:`CHUNK` by that many forked processes;
    each chunk stops at its first failure, the chunks not started yet are cancelled once one
    failed, and the failure of the lowest seed among those that ran is returned. The first seed
    runs here, before the fork, so that what a first schedule loads (pandas, which pyarrow
    imports when it first builds a batch: half a second) is loaded once, not in every process."""
    if processes <= 1 or schedules < 2 * CHUNK:
        return _explore_range(scenario, first_seed, schedules)
    first = _explore_range(scenario, first_seed, 1)
    if first is not None:
        return first
    gc.collect()
    gc.freeze()  # what the forked processes share is never scanned by their collections
    chunks = [(first_seed + start, min(CHUNK, schedules - start)) for start in range(1, schedules, CHUNK)]
    failures: list[Failure] = []
    with ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("fork")) as pool:
        running = [pool.submit(_explore_range, scenario, seed, count) for seed, count in chunks]
        for future in as_completed(running):
            if future.cancelled():
                continue
            failure = future.result()
            if failure is not None:
                failures.append(failure)
                for other in running:
                    other.cancel()
    return min(failures, key=lambda failure: failure.seed, default=None)


def outcome(failure: Failure | None) -> str:
    """What a run of schedules ended with, for its summary line."""
    return f"seed {failure.seed} failed" if failure else "every invariant held"


def _explore_range(scenario: Scenario, first_seed: int, schedules: int) -> Failure | None:
    quiet = logging.getLogger("oncekit")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        for seed in range(first_seed, first_seed + schedules):
            choices = Choices(seed)
            message, world = run_one(scenario, choices)
            if message is not None:
                return Failure(seed, choices.made, message + _replayed_here(scenario, world))
    finally:
        quiet.setLevel(level)
    return None


def _replayed_here(scenario: Scenario, explored: World) -> str:
    """What the failure's recorded choices do when replayed at once, in the process that explored
    them: a failure that passes here depended on more than its choices, and one that fails here
    but not in a fresh process (:func:`report`) on what this process kept from earlier schedules.
    Where the replay took another step than the exploring run, that step is named."""
    again, replay = run_one(scenario, Choices(recorded=list(explored.choices.made)))
    return (" [replayed at once in its explorer process: " + ("fails again" if again is not None else "PASSES")
            + parting(explored, replay) + "]")


def parting(first: World, second: World) -> str:
    """Where two runs of the same choices took different steps: nothing when they ran the same
    actors, else the first step where they part, with the actors each ran up to it."""
    ran = [[actor.name for actor in world.scheduler.ran] for world in (first, second)]
    if ran[0] == ran[1]:
        return ""
    step = next((i for i, (a, b) in enumerate(zip(*ran)) if a != b), min(map(len, ran)))
    up_to = [", ".join(names[max(0, step - 3):step + 1]) or "nothing" for names in ran]
    return (f"; the runs part at step {step + 1}: the explored one ran {up_to[0]} (of {len(ran[0])} steps), "
            f"the replay {up_to[1]} (of {len(ran[1])})")


def shrink(scenario: Scenario, failure: Failure, budget: int = 400) -> list[int]:
    """A shorter list of choices that still fails, as short as ``budget`` tries find."""
    quiet = logging.getLogger("oncekit")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)

    def fails(candidate: list[int]) -> bool:
        return run_one(scenario, Choices(recorded=candidate))[0] is not None

    best = list(failure.choices)
    tries = 0
    try:
        if not fails(best):
            return best  # it does not fail again here: nothing to shrink (report says so)
        improved = True
        while improved and tries < budget:
            improved = False
            for size in (len(best) // 2, len(best) // 4, 64, 16, 4, 1):
                start = 0
                while size > 0 and start < len(best) and tries < budget:
                    candidate = best[:start] + best[start + size:]
                    tries += 1
                    if fails(candidate):
                        best, improved = candidate, True
                    else:
                        start += size
            for index in range(len(best)):
                if tries >= budget:
                    break
                if best[index]:
                    candidate = best[:index] + [0] + best[index + 1:]
                    tries += 1
                    if fails(candidate):
                        best, improved = candidate, True
    finally:
        quiet.setLevel(level)
    return best


def report(scenario: Scenario, failure: Failure, shrunk: list[int]) -> str:
    """The failure, how to replay it, and the shrunk schedule's trace."""
    message, world = run_one(scenario, Choices(recorded=shrunk), trace=True)
    trace = world.scheduler.trace or []
    replayed = (f"shrunk to {len(shrunk)} choices ({len(failure.choices)} before), which fail with: {message}"
                if message is not None else
                f"NOT REPRODUCED: its {len(failure.choices)} recorded choices pass when replayed here, so the schedule "
                "depended on more than its choices (state its explorer process kept from earlier schedules); the "
                "trace below is the replay's")
    return "\n".join([
        f"{scenario.protocol}: seed {failure.seed} fails: {failure.message}",
        f"replay: python -m tests.sim.explore {scenario.protocol} --replay {failure.seed}",
        replayed,
        "trace of the schedule:",
        *trace,
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.sim.explore")
    parser.add_argument("protocol", choices=PROTOCOLS)
    parser.add_argument("--schedules", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--replay", type=int, default=None, help="run one seed and print its trace")
    parser.add_argument("--processes", type=int, default=1, help="explore in this many processes")
    args = parser.parse_args(argv)
    scenario = Scenario(args.protocol)
    if args.replay is not None:
        message, world = run_one(scenario, Choices(args.replay), trace=True)
        print("\n".join(world.scheduler.trace or []))
        print(f"seed {args.replay}: {message or 'every invariant held'}")
        return 1 if message else 0
    seed = args.seed if args.seed is not None else random.randrange(10**9)
    started = time.monotonic()
    failure = explore(scenario, args.schedules, seed, args.processes)
    print(f"{args.protocol}: {args.schedules} schedules from seed {seed} in {time.monotonic() - started:.1f} s: "
          f"{outcome(failure)}")
    if failure:
        print(report(scenario, failure, shrink(scenario, failure)))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A deterministic scheduler for the simulation of overlapping drivers.

Every actor (a driver's main loop, its listener, its lease keeper, a task on an executor) runs the
kit's real code in a greenlet of its own. The models of the services call :meth:`Scheduler.step`
at every operation, which hands control back here; the scheduler then picks which actor goes on,
and may pause or kill a process, by asking its :class:`Choices` (a seeded random source while
exploring; a recorded list when a failure is replayed or shrunk). Only one actor runs at a time
and nothing else is random, so a schedule is a function of its choices: a seed replays it.

Time is virtual (:class:`VirtualClock`, put in place of the kit's clock): it moves a little at
every step, and jumps when every actor waits. A paused process's actors do not run until their
pause is over; a killed process's actors never run again, as after kill -9 (no cleanup runs).
"""

from __future__ import annotations

import random
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import greenlet

STEP_S = 0.001
"""Virtual time one step takes."""

Label = str | Callable[[], str]
"""What a step does, for the trace: a text, or what makes it (called only when tracing, so that
the models do not format labels nobody reads)."""


def text(label: Label) -> str:
    """The label's text (made now, when it is made lazily)."""
    return label if isinstance(label, str) else label()


def prefixed(prefix: str, label: Label) -> Label:
    """``label`` after ``prefix``, still made only when traced."""
    if isinstance(label, str):
        return prefix + label
    return lambda: prefix + label()


class Choices:
    """Where a schedule's decisions come from: ``pick(n)`` is in ``range(n)``. Exploring draws
    them from a seeded generator and records them; replaying reads a recorded list (0 past its
    end: the plain choice, the first runnable actor and no fault)."""

    def __init__(self, seed: int | None = None, recorded: list[int] | None = None) -> None:
        self._random = random.Random(seed) if recorded is None else None
        self._recorded: list[int] = recorded or []
        self.made: list[int] = []

    def pick(self, n: int) -> int:
        if n <= 1:
            return 0
        if self._random is not None:
            value = int(self._random.random() * n)
        else:
            index = len(self.made)
            value = self._recorded[index] % n if index < len(self._recorded) else 0
        self.made.append(value)
        return value

    def chance(self, one_in: int) -> bool:
        """True about once in ``one_in`` picks (a fault, a pause): :meth:`pick`, asked before
        every step, written out."""
        if self._random is None:
            return self.pick(one_in) == one_in - 1
        value = int(self._random.random() * one_in)
        self.made.append(value)
        return value == one_in - 1


class Killed(greenlet.GreenletExit):
    """Raised in a greenlet of a killed process when the simulation ends, so that nothing of it
    runs on (its ``finally`` blocks meet :meth:`Scheduler.step`, which raises it again)."""


@dataclass(eq=False, slots=True)
class Process:
    """A process of the simulated cluster (a driver, an executor): what a pause or kill hits."""

    name: str
    paused_until: float = 0.0
    dead: bool = False
    on_kill: list[Callable[[], None]] = field(default_factory=list)


@dataclass(eq=False, slots=True)
class Actor:
    name: str
    process: Process
    run: Callable[[], Any]
    glet: Any = None
    done: bool = False
    wake_at: float = 0.0
    ready: Callable[[], bool] | None = None
    error: BaseException | None = None
    woke: bool = True
    """Chosen to run just now after it started, slept or waited: its next operation needs no
    step of its own (:meth:`Scheduler.step`)."""


class VirtualClock:
    """The kit's clock (:mod:`oncekit.core.clock`) in the simulation."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def now(self) -> float:
        return 1_800_000_000.0 + self.scheduler.time

    def monotonic(self) -> float:
        return self.scheduler.time

    def sleep(self, seconds: float) -> None:
        self.scheduler.sleep(seconds)


class _Worker:
    """A greenlet that runs one actor's body after another. An actor's greenlet is taken from the
    finished ones rather than made anew: a new greenlet maps a frame stack of its own, which it
    unmaps when it ends (8 µs of a schedule's 15 actors each, against 1 µs reused).

    A greenlet takes the recursion depth of the one that first switches to it, and keeps it. So
    the pool holds only greenlets started from the scheduler's own (:meth:`prime`, as shallow as
    :meth:`Scheduler.run`); one made when the pool is empty is first run by whichever actor
    chose it, from deep in that actor's stack, and ends with its actor instead of going back.
    Reused, it would carry that depth into every later actor, and the greenlets it starts
    deeper still, until plain calls of the kit raised RecursionError."""

    _idle: list[_Worker] = []
    POOL = 32
    """Idle greenlets kept ready. The scheduler fills the pool again whenever control comes back
    to it; in 1,800 schedules of every protocol, at most 6 were taken in between, and no actor
    found the pool empty."""

    def __init__(self, main: Any, pooled: bool) -> None:
        self.body: Callable[[], None] | None = None
        self.pooled = pooled
        self.glet = greenlet.greenlet(self._serve, parent=main)

    @classmethod
    def prime(cls, main: Any) -> None:
        """Called by the scheduler in its own greenlet ``main``: fill the pool with greenlets
        started here, each waiting for a body."""
        while len(cls._idle) < cls.POOL:
            worker = cls(main, pooled=True)
            worker.glet.switch()
            cls._idle.append(worker)

    @classmethod
    def take(cls, main: Any, body: Callable[[], None]) -> Any:
        """A greenlet whose next switch runs ``body``: a pooled one, back to the pool once ``body``
        returned; a new one, which ends with it, when the pool is empty."""
        worker = cls._idle.pop() if cls._idle else cls(main, pooled=False)
        worker.glet.parent, worker.body = main, body
        return worker.glet

    def _serve(self) -> None:
        while True:
            if self.body is None:
                self.glet.parent.switch()  # idle: until taken and switched to
            body, self.body = self.body, None
            assert body is not None
            body()
            del body  # the ended actor's world is not kept alive by an idle greenlet
            if not self.pooled:
                return
            self._idle.append(self)


class Scheduler:
    """Runs actors one step at a time, as :class:`Choices` say."""

    def __init__(self, choices: Choices, trace: bool = False) -> None:
        self.choices = choices
        self.time = 0.0
        self.actors: list[Actor] = []  # live ones (and those that ended since the last step)
        self.everyone: list[Actor] = []
        self.current: Actor | None = None
        self.steps = 0
        self.trace: list[str] | None = [] if trace else None
        self._main = greenlet.getcurrent()
        _Worker.prime(self._main)  # before the world spawns its first actors
        self._ended = False  # an actor finished or a process was killed: drop them from actors
        self._max_steps = 0
        self._between: Callable[[], None] = lambda: None
        self._outcome: bool | None = None  # how the schedule ended: every actor done, or the step budget
        self.ran: list[Actor] = []
        """The actor chosen at each step, in order: where two runs of the same choices part
        (:func:`tests.sim.explore.parting`)."""
        self.strays: list[str] = []
        """What went wrong in the simulation itself: operations reached outside the current actor's
        greenlet (a finalizer that the garbage collector ran, say), which take no step, and errors
        raised while a step chose who goes on, which end the schedule. The world fails the
        schedule with them."""

    # -- called by actors (through the models) ---------------------------------------------------

    def step(self, label: Label = "", wake_at: float = 0.0) -> None:
        """An actor reached an operation (or sleeps or waits, with ``wake_at``): choose who goes
        on (this actor again no earlier than ``wake_at``). The choice is made here, in the
        actor's greenlet, and control passes straight to the chosen actor: none when it is this
        one (most steps), and back to :meth:`run` only when the schedule ends.

        The first operation of an actor chosen after it started, slept or waited goes on at once:
        the choice that woke it was its scheduling point (any later moment for it is reached by
        choosing others first), and nothing it does in between can be seen."""
        actor = self.current
        if actor is None:
            return  # outside the simulation (building the world)
        if greenlet.getcurrent() is not actor.glet:
            self.strays.append(f"{text(label)} outside {actor.name}'s greenlet:\n" + "".join(traceback.format_stack(limit=12)))
            return
        process = actor.process
        if process.dead:
            raise Killed()
        if self.trace is not None:
            self.trace.append(f"{self.time:9.3f} {actor.name}: {text(label)}")
        if actor.woke:
            actor.woke = False
            if not wake_at:
                return
        actor.wake_at = wake_at
        self.current = None
        try:
            chosen = self._next()
        except BaseException as exc:  # noqa: BLE001 - the simulation's own error: it ends the schedule
            self.strays.append(f"choosing the step after {actor.name}'s {text(label)}: {type(exc).__name__}: {exc}\n"
                               + traceback.format_exc(limit=-12))
            self._outcome, chosen = False, None
        if chosen is not actor:
            (self._main if chosen is None else chosen.glet).switch()
        self.current = actor
        actor.woke = bool(wake_at)
        if process.dead:
            raise Killed()

    def sleep(self, seconds: float) -> None:
        actor = self.current
        if actor is None:
            self.time += seconds
            return
        self.step(lambda: f"sleep {seconds:.3f}", self.time + seconds)

    def wait_until(self, ready: Callable[[], bool], timeout_s: float, label: Label) -> bool:
        """Block the current actor until ``ready()`` or ``timeout_s`` of virtual time passed;
        whether it became ready."""
        deadline = self.time + timeout_s
        actor = self.current
        assert actor is not None
        waiting = prefixed("wait ", label)
        while not ready():
            if self.time >= deadline:
                return False
            actor.ready = ready
            try:
                self.step(waiting, deadline)
            finally:
                actor.ready = None
        return True

    # -- the world's side ----------------------------------------------------------------------

    def spawn(self, name: str, process: Process, run: Callable[[], Any]) -> Actor:
        actor = Actor(name, process, run)

        def body() -> None:
            try:
                run()
            except Killed:
                pass  # the schedule ended (close): its greenlet goes back to the pool all the same
            except greenlet.GreenletExit:
                raise  # ended by greenlet itself (collected): it ends, and is never reused
            except BaseException as exc:  # noqa: BLE001 - the world looks at it
                actor.error = exc
            finally:
                actor.done = True
                self._ended = True

        actor.glet = _Worker.take(self._main, body)
        self.actors.append(actor)
        self.everyone.append(actor)
        return actor

    def kill(self, process: Process) -> None:
        if process.dead:
            return
        process.dead = True
        self._ended = True
        if self.trace is not None:
            self.trace.append(f"{self.time:9.3f} ** kill {process.name}")
        for hook in process.on_kill:
            hook()

    def pause(self, process: Process, seconds: float) -> None:
        process.paused_until = max(process.paused_until, self.time + seconds)
        if self.trace is not None:
            self.trace.append(f"{self.time:9.3f} ** pause {process.name} for {seconds:.1f} s")

    def run(self, max_steps: int, between: Callable[[], None] = lambda: None) -> bool:
        """Run until every live actor is done (True) or ``max_steps`` steps (False); ``between``
        runs before each step (the world's faults). Actors pass control among themselves
        (:meth:`step`); it comes back here when one ends or the schedule does."""
        self._max_steps, self._between, self._outcome = max_steps, between, None
        while self._outcome is None:
            actor = self._next()
            if actor is not None:
                actor.glet.switch()
                _Worker.prime(self._main)  # the actors spawned meanwhile took some
            self.current = None
        return self._outcome

    def _next(self) -> Actor | None:
        """Count a step and choose the actor it runs, as :class:`Choices` say (the chosen one is
        :attr:`current` from here on); None when the schedule ended (:attr:`_outcome` says how).

        An actor is runnable when its process is neither dead nor paused and its wait is over
        (its ``ready()`` is asked first, every time: the models' conditions end expired sessions);
        the first live actor in spawning order is choice 0. When none is, time jumps to the
        earliest wake-up."""
        while self.steps < self._max_steps:
            if self._ended:
                self._ended = False
                self.actors = [a for a in self.actors if not a.done and not a.process.dead]
            live = self.actors  # a process killed by ``between`` leaves it at the next step
            if not live:
                self._outcome = True
                return None
            self._between()
            now = self.time
            runnable = []
            for actor in live:
                process = actor.process
                if actor.done or process.dead or process.paused_until > now:
                    continue
                ready = actor.ready
                if (ready() or now >= actor.wake_at) if ready is not None else now >= actor.wake_at:
                    runnable.append(actor)
            if not runnable:
                self.time = max(now + STEP_S, min([max(a.wake_at, a.process.paused_until) for a in live]))
                continue
            actor = runnable[self.choices.pick(len(runnable))] if len(runnable) > 1 else runnable[0]
            self.current = actor
            self.ran.append(actor)
            self.steps += 1
            self.time = now + STEP_S
            return actor
        self._outcome = False
        return None

    def close(self) -> None:
        """End the simulation: every greenlet still suspended is thrown out (its process counts as
        dead, so what it would still do raises)."""
        for actor in self.everyone:
            actor.process.dead = True
        for actor in self.everyone:
            if not actor.done and actor.glet:
                try:
                    self.current = actor
                    actor.glet.throw(Killed())
                except Killed:
                    pass
                finally:
                    self.current = None

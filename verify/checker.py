"""The multiset checker: :func:`compare` checks committed output against expected output as
multisets, because a count can hide a loss and a duplicate that cancel out; a multiset
comparison cannot. Its :class:`Verdict` says which delivery guarantee the output meets.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

GUARANTEES = ("exactly-once", "at-least-once", "at-most-once")

# The verdict names (Verdict.name) each guarantee accepts.
ALLOWED_VERDICTS = {"exactly-once": {"exactly-once"}, "at-least-once": {"exactly-once", "duplicates"},
                    "at-most-once": {"exactly-once", "LOSS"}}


@dataclass(frozen=True)
class Verdict:
    """What :func:`compare` found. ``exactly_once`` holds when nothing was lost, nothing
    repeated and nothing appeared that was never expected."""

    expected: int
    actual: int
    lost: Counter[Hashable]
    duplicated: Counter[Hashable]
    unexpected: Counter[Hashable]

    @property
    def exactly_once(self) -> bool:
        return not (self.lost or self.duplicated or self.unexpected)

    @property
    def at_least_once(self) -> bool:
        return not self.lost and not self.unexpected

    @property
    def at_most_once(self) -> bool:
        return not self.duplicated and not self.unexpected

    def holds(self, guarantee: str) -> bool:
        return {"exactly-once": self.exactly_once, "at-least-once": self.at_least_once,
                "at-most-once": self.at_most_once}[guarantee]

    @property
    def name(self) -> str:
        if self.exactly_once:
            return "exactly-once"
        if self.lost and self.duplicated:
            return "LOSS+DUPLICATES"
        return "duplicates" if self.at_least_once else "LOSS"

    def summary(self, examples: int = 5) -> str:
        def show(counter: Counter[Hashable]) -> str:
            items = sorted(counter.items(), key=repr)[:examples]
            return f"{sum(counter.values())} {items}" if counter else "0"

        return (f"expected {self.expected}, got {self.actual}; lost {show(self.lost)}; "
                f"duplicated {show(self.duplicated)}; unexpected {show(self.unexpected)}")


def compare(expected: Iterable[Hashable], actual: Iterable[Hashable]) -> Verdict:
    """Compare two multisets of records (any hashable: tuples, strings)."""
    want, got = Counter(expected), Counter(actual)
    surplus = got - want
    return Verdict(
        expected=sum(want.values()),
        actual=sum(got.values()),
        lost=want - got,
        duplicated=Counter({k: v for k, v in surplus.items() if k in want}),
        unexpected=Counter({k: v for k, v in surplus.items() if k not in want}),
    )

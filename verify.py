"""The exactly-once checker: committed output against expected output, as multisets.

A count can hide a loss and a duplicate that cancel out; a multiset comparison cannot. Every
exactly-once claim in oncekit's tests goes through :func:`compare`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable
from dataclasses import dataclass


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

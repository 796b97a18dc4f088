from __future__ import annotations

from oncekit.verify import compare


def test_compare_same_multiset_is_exactly_once() -> None:
    assert compare([1, 2, 2, 3], [3, 2, 1, 2]).exactly_once


def test_compare_catches_loss_and_duplicate_with_equal_counts() -> None:
    verdict = compare([1, 2, 3], [1, 1, 3])
    assert not verdict.exactly_once
    assert verdict.lost == {2: 1} and verdict.duplicated == {1: 1}
    assert "lost 1" in verdict.summary()


def test_compare_duplicates_only_is_at_least_once() -> None:
    verdict = compare([1, 2], [1, 2, 2])
    assert verdict.at_least_once and not verdict.exactly_once


def test_compare_unexpected_record_is_not_exactly_once() -> None:
    verdict = compare([1], [1, 9])
    assert verdict.unexpected == {9: 1} and not verdict.exactly_once

"""The T27 checker on small hand-made histories, legal and illegal (its negative controls)."""

from __future__ import annotations

import math

from .linearizability import Op, check

INF = math.inf


def op(p: str, f: str, a: float, b: float, t: str = "ok") -> Op:
    return Op(p, f, a, b, t)


def test_sequential_history_is_linearizable() -> None:
    h = [
        op("A", "acquire", 0, 1),
        op("A", "release", 2, 3),
        op("B", "acquire", 4, 5),
        op("B", "release", 6, 7),
    ]
    assert check(h)


def test_two_owners_at_once_is_not() -> None:
    h = [
        op("A", "acquire", 0, 1),
        op("B", "acquire", 2, 3),
        op("A", "release", 4, 5),
        op("B", "release", 6, 7),
    ]
    assert not check(h)


def test_overlapping_calls_can_reorder() -> None:
    h = [
        op("A", "acquire", 0, 10),
        op("B", "acquire", 1, 2),
        op("B", "release", 3, 4),
        op("A", "release", 11, 12),
    ]
    assert check(h)


def test_failed_acquire_needs_a_holder() -> None:
    assert not check([op("A", "acquire", 0, 1, "fail")])
    assert check(
        [op("B", "acquire", 0, 1), op("A", "acquire", 2, 3, "fail"), op("B", "release", 4, 5)]
    )


def test_release_by_non_owner_is_not() -> None:
    assert not check([op("A", "acquire", 0, 1), op("B", "release", 2, 3)])


def test_info_ops_may_or_may_not_happen() -> None:
    # An unknown acquire that never took effect.
    assert check([op("A", "acquire", 0, INF, "info"), op("B", "acquire", 1, 2)])
    # A holder that died: its session's end is an unknown release, needed for B to get in.
    died = [op("A", "acquire", 0, 1), op("A", "release", 2, INF, "info"), op("B", "acquire", 3, 4)]
    assert check(died)
    assert not check(died[:1] + died[2:])
    # An unknown release cannot take effect before it was invoked.
    assert not check(
        [op("A", "acquire", 0, 1), op("B", "acquire", 2, 3), op("A", "release", 5, INF, "info")]
    )

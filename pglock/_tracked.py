"""The objects of pglock with locks of their own, which a forked child re-initialises."""

from __future__ import annotations

import weakref
from typing import Any

objects: weakref.WeakSet[Any] = weakref.WeakSet()  # every live instance of a Tracked class


class Tracked:
    """A class whose instances have locks, conditions or events: listed in :data:`objects`."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        objects.add(self := super().__new__(cls))
        return self

    def _forget_threads(self) -> None:
        """In a forked child: drop the record of what the parent's threads were doing in this
        object (an acquire or a run in progress, a count of waiters): none of them is here."""

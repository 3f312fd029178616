"""``python -m pglock``: the ``pglock`` command (see :mod:`pglock.cli`)."""

from __future__ import annotations

from .cli import main

raise SystemExit(main())

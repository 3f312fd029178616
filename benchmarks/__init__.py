"""Side-by-side benchmarks of pglock, raw psycopg and peer lock libraries.

Run ``python -m benchmarks.run --help`` from the repository root; see benchmarks/README.md.
"""

from __future__ import annotations

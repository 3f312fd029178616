"""The demo runs end to end against the test server and pglock keeps every job to one run."""

from __future__ import annotations

import io

from pglock._demo import run_demo


def test_demo_with_pglock_has_no_duplicates(pg_dsn: str) -> None:
    out = io.StringIO()
    result = run_demo(pg_dsn, workers=3, jobs=60, out=out)
    assert result.with_lock.jobs == 60
    assert result.with_lock.runs == 60
    assert result.with_lock.duplicates == 0
    # Without locks every job still ends done, with runs >= jobs (collisions are likely, not
    # certain, so the count of duplicates is reported rather than asserted).
    assert result.without_lock.jobs == 60
    assert result.without_lock.runs == 60 + result.without_lock.duplicates
    assert result.handoff_p50_ms > 0
    text = out.getvalue()
    assert "duplicates: 0" in text
    assert "Summary" in text

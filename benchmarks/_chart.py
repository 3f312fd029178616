"""The headline chart: uncontended cycle cost against the raw floor, and handoff latency."""

from __future__ import annotations

from pathlib import Path
from typing import Any

COLORS = {"postgres": "#4C72B0", "redis": "#C44E52", "lease": "#55A868"}
PGLOCK = "#2CA02C"


def _color(key: str, group: str) -> str:
    return PGLOCK if key.startswith(("pglock", "lease")) else COLORS.get(group, "#888888")


def draw(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    w = result["workloads"]
    a = {k: v for k, v in (w.get("A", {}).get("adapters") or {}).items() if v.get("ratio")}
    c = {k: v for k, v in (w.get("C", {}).get("adapters") or {}).items() if v.get("p50_ms")}
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5.6))

    items = sorted(a.items(), key=lambda kv: kv[1]["ratio"])
    left.barh(
        [v["label"] for _, v in items],
        [v["ratio"] for _, v in items],
        color=[_color(k, v.get("group", "")) for k, v in items],
    )
    for i, (_, v) in enumerate(items):
        left.text(v["ratio"], i, f" {v['ratio']:.2f}x", va="center", fontsize=8)
    left.axvline(1.0, color="black", linewidth=0.8)
    left.axvline(1.1, color="gray", linewidth=0.8, linestyle="--")
    left.set_xscale("log")
    left.set_xlabel("p50 / raw psycopg p50 (log scale)")
    left.set_title("A. Cost of an uncontended cycle vs the raw floor")
    left.tick_params(axis="y", labelsize=8)
    left.set_xlim(0.5, max([v["ratio"] for v in a.values()] + [1.2]) * 2.5)

    items_c = sorted(c.items(), key=lambda kv: kv[1]["p50_ms"])
    right.barh(
        [v["label"] for _, v in items_c],
        [v["p50_ms"] for _, v in items_c],
        color=[_color(k, v.get("group", "")) for k, v in items_c],
    )
    for i, (_, v) in enumerate(items_c):
        right.text(v["p50_ms"], i, f" {v['p50_ms']:.2f} ms", va="center", fontsize=8)
    right.set_xscale("log")
    right.set_xlabel("release -> waiter acquired, p50 ms (log scale)")
    right.set_title("C. Handoff to a blocked waiter")
    right.tick_params(axis="y", labelsize=8)
    if c:
        right.set_xlim(
            min(v["p50_ms"] for v in c.values()) / 2, max(v["p50_ms"] for v in c.values()) * 6
        )

    env = result.get("environment_line", "")
    quick = "  [--quick: numbers not meaningful]" if result.get("quick") else ""
    fig.suptitle(f"pglock benchmarks {result.get('date', '')}{quick}\n{env}", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)

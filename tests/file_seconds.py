"""Each test file's measured seconds, for the order in which CI's two xdist workers take files (conftest.py).

xdist's `--dist loadfile` hands out whole files in collection order (with `--no-loadscope-reorder`); the
longest first, then shorter ones filling in, keeps one worker from running a long file alone at the end.
Each file's figure is split into its `heavy` tests (marked slow, vllm, ray, postgres, real_model or browser)
and its `light` ones, so the fast tier orders by its own share. The figures are a full run's
(`pytest --junitxml=FILE`), refreshed with

    python tests/file_seconds.py FILE

which rewrites file_seconds.json beside this script. A file missing from it (a new one) is estimated from
its tests' markers.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

FIGURES = Path(__file__).with_name("file_seconds.json")
HEAVY_MARKERS = ("slow", "vllm", "ray", "postgres", "real_model", "browser")
ESTIMATE_S = {"heavy": 30.0, "light": 0.5}  # a test of a file not measured yet


def from_junit(path: str, heavy_ids: set[str]) -> dict[str, dict[str, float]]:
    """Seconds per file and tier from a junit XML; `heavy_ids`: the node ids of the heavy tests."""
    figures: dict[str, dict[str, float]] = {}
    for case in ElementTree.parse(path).iter("testcase"):
        # classname: the file's dotted path (then a test class's name); name: the test's, with its parameters
        dotted = [part for part in case.get("classname", "").split(".") if not part[:1].isupper()]
        file = "/".join(dotted) + ".py"
        tier = "heavy" if f"{file}::{case.get('name')}" in heavy_ids else "light"
        tiers = figures.setdefault(file, {"heavy": 0.0, "light": 0.0})
        tiers[tier] += float(case.get("time", 0))
    return {file: {tier: round(s, 1) for tier, s in tiers.items()} for file, tiers in sorted(figures.items())}


def load() -> dict[str, dict[str, float]]:
    return json.loads(FIGURES.read_text()) if FIGURES.exists() else {}


def tier(item) -> str:  # noqa: ANN001  (a pytest Item)
    return "heavy" if any(item.get_closest_marker(marker) for marker in HEAVY_MARKERS) else "light"


def longest_files_first(items: list) -> list:  # noqa: ANN001  (pytest Items)
    """`items` with whole files in order of their selected tests' seconds, longest first."""
    figures, by_file = load(), {}
    for item in items:
        by_file.setdefault(item.nodeid.split("::")[0], []).append(item)

    def seconds(file: str) -> float:
        tiers = {tier(item) for item in by_file[file]}
        if file in figures:
            return sum(figures[file][tier] for tier in tiers)
        return sum(ESTIMATE_S[tier(item)] for item in by_file[file])

    return [item for file in sorted(by_file, key=seconds, reverse=True) for item in by_file[file]]


if __name__ == "__main__":
    # The heavy tests' ids: collected here, as pytest sees the markers.
    import subprocess

    listed = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", " or ".join(HEAVY_MARKERS)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    heavy_ids = {line.strip() for line in listed.splitlines() if "::" in line}
    FIGURES.write_text(json.dumps(from_junit(sys.argv[1], heavy_ids), indent=1) + "\n")

"""`grpo report RUN`: one PNG of a run's training curves, read from its Parquet metrics.

Panels, per step, for each metric the run logged (a column absent or all null is left out,
e.g. `kl` when beta = 0): reward (with a band of one reward_std), loss, KL, mean completion
length; and, when the run has been evaluated (flows/evaluate.py), held-out pass@1 / pass@k /
greedy accuracy per checkpoint. Nothing is computed that the Parquet files do not hold.

Needs matplotlib (imported here only, with the non-interactive Agg backend).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo_flow.schemas.config import check_run_id
from grpo_flow.workers.state.storage import RunStorage, atomic_write

# (metrics column, panel title, band column drawn as +/- one value around the line)
PANELS: tuple[tuple[str, str, str | None], ...] = (
    ("reward", "reward (mean; band: one std)", "reward_std"),
    ("loss", "loss", None),
    ("kl", "KL to the reference", None),
    ("completions/mean_length", "completion length (tokens)", None),
)


class ReportError(ValueError):
    """Nothing to plot: unknown run, or no metrics logged yet."""


@dataclass(frozen=True)
class Report:
    path: Path
    panels: tuple[str, ...]  # the metrics columns plotted, plus "eval" when there was an evaluation
    steps: int


def _series(table: Any, column: str) -> tuple[list[int], list[float]]:
    """(steps, values) of a column, without the steps where it is null or NaN."""
    if column not in table.column_names:
        return [], []
    pairs = [
        (step, float(value))
        for step, value in zip(table["step"].to_pylist(), table[column].to_pylist(), strict=True)
        if value is not None and not math.isnan(float(value))
    ]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _eval_series(storage: RunStorage) -> dict[str, tuple[list[int], list[float]]]:
    """pass@1, pass@k (the largest k) and greedy accuracy per evaluated checkpoint."""
    from grpo_flow.flows.evaluate import read_eval_summary

    series: dict[str, tuple[list[int], list[float]]] = {}
    for step in storage.evaluated_steps():
        summary = read_eval_summary(storage.eval_path(step))
        passes = sorted((k for k in summary if k.startswith("pass@")), key=lambda k: int(k.split("@")[1]))
        names = ([passes[0], passes[-1]] if passes else []) + ["greedy_accuracy"]
        for name in dict.fromkeys(names):
            value = summary.get(name)
            if value is None or math.isnan(value):
                continue
            steps, values = series.setdefault(name, ([], []))
            steps.append(step)
            values.append(value)
    return series


def write_report(storage_root: str | os.PathLike, run_id: str, out: str | os.PathLike | None = None) -> Report:
    """Plot the run's curves into `out` (default `<run>/report.png`), written atomically; returns what was drawn."""
    try:
        check_run_id(run_id)  # a name under the storage root, never a path out of it
    except ValueError as error:
        raise ReportError(str(error)) from None
    storage = RunStorage(storage_root, run_id)
    if not storage.exists():
        raise ReportError(f"no run {run_id!r} under {os.path.join(storage_root, 'runs')}")
    table = storage.read_metrics()
    if table.num_rows == 0:
        raise ReportError(f"run {run_id!r} has no logged steps yet")
    panels = [(column, title, band) for column, title, band in PANELS if _series(table, column)[0]]
    evaluation = _eval_series(storage)
    count = len(panels) + (1 if evaluation else 0)
    if count == 0:
        raise ReportError(f"run {run_id!r} logged none of {', '.join(c for c, _, _ in PANELS)}")

    import matplotlib

    matplotlib.use("Agg")  # no display: a file is the only output
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    columns = 2 if count > 1 else 1
    rows = math.ceil(count / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(6 * columns, 3.4 * rows), squeeze=False)
    flat = list(axes.flat)
    for axis, (column, title, band) in zip(flat, panels, strict=False):
        steps, values = _series(table, column)
        axis.plot(steps, values, marker="." if len(steps) < 60 else None, linewidth=1.2)
        band_steps, band_values = _series(table, band) if band else ([], [])
        if band_steps == steps and band_steps:
            axis.fill_between(
                steps,
                [v - s for v, s in zip(values, band_values, strict=True)],
                [v + s for v, s in zip(values, band_values, strict=True)],
                alpha=0.2,
            )
        axis.set_title(title)
        axis.set_xlabel("step")
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
        axis.grid(alpha=0.3)
    if evaluation:
        axis = flat[len(panels)]
        for name, (steps, values) in evaluation.items():
            axis.plot(steps, values, marker="o", label=name.replace("_", " "))
        axis.set_title("held-out evaluation (per checkpoint)")
        axis.set_xlabel("checkpoint step")
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        axis.set_ylim(-0.02, 1.02)
        axis.legend(fontsize="small")
        axis.grid(alpha=0.3)
    for axis in flat[count:]:
        axis.set_visible(False)
    figure.suptitle(f"grpo-flow run {run_id} ({table.num_rows} steps)")
    figure.tight_layout()

    path = Path(out) if out is not None else storage.run_dir / "report.png"
    try:
        atomic_write(path, lambda tmp: figure.savefig(tmp, dpi=110, format="png"))  # never half a PNG
    finally:
        plt.close(figure)
    drawn = tuple(column for column, _, _ in panels) + (("eval",) if evaluation else ())
    return Report(path=path, panels=drawn, steps=table.num_rows)

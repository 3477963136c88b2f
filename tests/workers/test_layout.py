"""The import rules the layout promises (workers/__init__.py, DESIGN.md), checked on the source.

One import package: the top-level folders are `grpo_flow.flows`, `grpo_flow.tasks`, ... through
the links in grpo_flow/, and nothing imports them under their bare names.
flows -> tasks -> workers -> schemas, never back; nothing under workers/ imports Prefect;
worker packages import only the packages below them in workers/__init__.py's list.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# workers/__init__.py's list, top to bottom: a package may import those after it.
WORKER_PACKAGES = ["backends", "actor", "rollout", "tools", "rewards", "data", "state"]
# The upward imports, lazy and documented in workers/data/__init__.py: building a tiny model records its
# held-out accuracy with a rollout engine (tiny-tools: with its tool, in multi-turn episodes).
ALLOWED_UPWARD = {
    ("workers/data/tiny_model.py", "workers.rollout"),
    ("workers/data/tiny_tools.py", "workers.rollout"),
    ("workers/data/tiny_tools.py", "workers.tools"),
}
SUBPACKAGES = ["flows", "tasks", "workers", "schemas", "deployments"]


def imports(path: Path) -> list[str]:
    """Every module a file imports, at any depth (lazy imports inside functions included), with
    grpo_flow's own named without the `grpo_flow.` prefix (`workers.rollout`)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return [name.removeprefix("grpo_flow.") for name in names if name.startswith("grpo_flow.")]


def files(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


@pytest.mark.parametrize("folder", ["workers", "schemas"])
def test_no_prefect_and_no_upward_imports(folder):
    for path in files(folder):
        for name in imports(path):
            top = name.split(".")[0]
            assert top != "prefect", f"{rel(path)} imports {name}: {folder}/ knows nothing of Prefect"
            assert top not in ("flows", "tasks", "deployments"), f"{rel(path)} imports {name}: imports point down"
            if folder == "schemas":
                assert top != "workers", f"{rel(path)} imports {name}: schemas/ is the bottom layer"


def test_tasks_never_import_flows():
    for path in files("tasks"):
        for name in imports(path):
            assert name.split(".")[0] not in ("flows", "deployments"), f"{rel(path)} imports {name}"


def test_worker_packages_import_only_those_below_them():
    for package in WORKER_PACKAGES:
        below = WORKER_PACKAGES[WORKER_PACKAGES.index(package) :]
        for path in files(f"workers/{package}"):
            for name in imports(path):
                parts = name.split(".")
                if parts[0] != "workers" or len(parts) < 2:
                    continue
                target = f"workers.{parts[1]}"
                if parts[1] in below or (rel(path), target) in ALLOWED_UPWARD:
                    continue
                pytest.fail(f"{rel(path)} imports {name}: workers.{package} may import only {below}")


def test_every_worker_module_is_in_a_role_package():
    loose = [rel(p) for p in (ROOT / "workers").glob("*.py") if p.name != "__init__.py"]
    assert not loose, f"modules outside a role package: {loose}"
    for package in WORKER_PACKAGES:
        doc = ast.get_docstring(ast.parse((ROOT / "workers" / package / "__init__.py").read_text()))
        assert doc and "Imports" in doc, f"workers/{package}/__init__.py must say what it holds and may import"


def test_cli_and_components_do_not_import_each_other():
    cli, components = ROOT / "flows/cli.py", ROOT / "flows/components.py"
    assert "flows.cli" not in imports(components)
    # cli registers the component commands; the shared pieces live in flows/cli_common.py
    assert "flows.components" in imports(cli)


def test_grpo_flow_is_the_package_init_and_a_link_to_each_top_level_folder():
    package = ROOT / "grpo_flow"
    links = {p.name: p for p in package.iterdir() if p.is_symlink()}
    assert sorted(links) == sorted(SUBPACKAGES)
    for name, link in links.items():
        assert link.resolve() == ROOT / name and (ROOT / name / "__init__.py").exists()
    others = sorted(p.name for p in package.iterdir() if not p.is_symlink() and p.name != "__pycache__")
    assert others == ["__init__.py", "__main__.py"]


@pytest.mark.parametrize("folder", [*SUBPACKAGES, "benchmarks", "tests", "grpo_flow"])
def test_project_code_is_imported_only_as_grpo_flow(folder):
    for path in (
        sorted((ROOT / folder).rglob("*.py")) if folder != "grpo_flow" else sorted((ROOT / folder).glob("*.py"))
    ):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                bare = [alias.name for alias in node.names if alias.name.split(".")[0] in SUBPACKAGES]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                bare = [node.module] if node.module.split(".")[0] in SUBPACKAGES else []
            else:
                bare = []
            assert not bare, f"{rel(path)} imports {bare[0]}: write grpo_flow.{bare[0]}"


def test_every_rollout_engine_offers_the_protocols_methods():
    """workers/rollout/base.py's RolloutEngine: what the servers and weight sync call on any engine."""
    from grpo_flow.workers.rollout.base import RolloutEngine
    from grpo_flow.workers.rollout.process_engine import ProcessRolloutEngine
    from grpo_flow.workers.rollout.transformers_engine import TransformersRolloutEngine
    from grpo_flow.workers.rollout.vllm_engine import VLLMRolloutEngine
    from grpo_flow.workers.rollout.vllm_process import VLLMProcessEngine

    methods = ["load", "generate", "load_state_dict", "recreate", "close"]
    assert all(hasattr(RolloutEngine, name) for name in [*methods, "model"])  # `model`: an attribute or property
    for engine in (TransformersRolloutEngine, ProcessRolloutEngine, VLLMRolloutEngine, VLLMProcessEngine):
        missing = [name for name in methods if not hasattr(engine, name)]
        assert not missing, f"{engine.__name__} lacks {missing}"


def test_each_backend_is_a_placement_of_the_one_workers_implementation():
    """Backends supply where workers run and how they are called; heal, resume and sync live in Workers alone."""
    from grpo_flow.workers.backends.local import LocalPlacement
    from grpo_flow.workers.backends.modal_backend import ModalPlacement
    from grpo_flow.workers.backends.ray_backend import RayPlacement
    from grpo_flow.workers.backends.workers import Placement, Workers

    shared = {"restore", "sync_weights", "save_checkpoint", "generate", "actor_step", "_heal_actor", "_heal_engine"}
    for placement in (LocalPlacement, ModalPlacement, RayPlacement):
        assert issubclass(placement, Placement)
        assert not shared & set(vars(placement)), f"{placement.__name__} redefines what Workers does"
    assert shared <= set(vars(Workers))

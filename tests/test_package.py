"""The wheel as a user installs it: one import package, beside a Prefect project's own `flows/`, `tasks/`
and `workers/` packages.

The wheel is built from this checkout (not an editable install) and installed without its dependencies
into a fresh virtual environment, which takes the dependencies from this test environment's
site-packages through a plain path entry (the editable install of grpo_flow there is a `.pth` hook,
which a plain path entry does not run). Runs happen from a folder holding the user's own packages.
"""

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOP_LEVEL = ["flows", "tasks", "workers", "schemas", "deployments", "benchmarks"]  # none of them in site-packages

USER_API_RUN = """
import sys
import flows, tasks, workers
from datasets import Dataset
from grpo_flow import GRPOFlowTrainer

assert (flows.WHO, tasks.WHO, workers.WHO) == ("user", "user", "user")

def exact(completions, answer, **kwargs):
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]

prompts = [f"{1000 + 37 * i}=" for i in range(40)]
dataset = Dataset.from_dict({"prompt": prompts, "answer": [p[-2] for p in prompts]})
trainer = GRPOFlowTrainer(model="tiny", reward_funcs=[exact], train_dataset=dataset, storage_root="store",
                          max_steps=2, prompts_per_step=4, num_generations=2, max_completion_length=2,
                          eval_prompts=0)
summary = trainer.train()
import grpo_flow.flows.grpo
assert flows.WHO == "user" and grpo_flow.flows.grpo.__file__.startswith(sys.argv[1])
print("status", summary["status"], summary["steps_completed"])
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(the fresh environment's python, its site-packages) with the wheel installed."""
    work = tmp_path_factory.mktemp("wheel")
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(work), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = work.glob("grpo_flow-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        tops = {name.split("/")[0] for name in archive.namelist() if not name.startswith("grpo_flow-")}
    assert tops == {"grpo_flow"}, tops
    env = work / "env"
    subprocess.run([sys.executable, "-m", "venv", str(env)], check=True, timeout=300)
    python = env / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    (site / "test-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    done = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return python, site


@pytest.fixture
def user_project(tmp_path):
    """A Prefect user's project folder with packages of the generic names grpo-flow's folders have."""
    for name in ("flows", "tasks", "workers"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text('WHO = "user"\n')
    return tmp_path


def run(argv, cwd, timeout=600):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PREFECT_API_URL")}
    env["GRPO_FLOW_STORAGE"] = str(cwd / "store")
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_site_packages_gets_grpo_flow_alone(installed):
    _, site = installed
    assert (site / "grpo_flow" / "flows" / "grpo.py").is_file()  # real folders, not links
    assert not (site / "grpo_flow" / "flows").is_symlink()
    assert not [name for name in TOP_LEVEL if (site / name).exists()]
    assert not (site / "grpo_flow" / "benchmarks").exists()  # they run from a checkout


@pytest.mark.slow
def test_the_cli_and_the_api_run_from_a_project_with_its_own_flows_tasks_and_workers(installed, user_project):
    python, site = installed
    trained = run(
        [str(python.parent / "grpo"), "train", "--preset", "tiny", "--max-steps", "2", "--no-progress"], user_project
    )
    assert trained.returncode == 0, trained.stdout[-2000:] + trained.stderr[-2000:]
    assert "completed" in trained.stdout and "2 / 2" in trained.stdout
    as_module = run([str(python), "-m", "grpo_flow", "runs"], user_project)
    assert as_module.returncode == 0 and "completed" in as_module.stdout, as_module.stderr[-2000:]
    api = run([str(python), "-c", USER_API_RUN, str(site)], user_project)
    assert api.returncode == 0, api.stdout[-2000:] + api.stderr[-2000:]
    assert api.stdout.strip().endswith("status completed 2")

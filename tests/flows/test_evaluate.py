"""The `evaluate` flow: pass@k (Chen et al.'s estimator), eval files that are never overwritten,
the table artifact, wandb (offline), and the nightly sweep that skips what is up to date."""

import itertools
import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from grpo_flow.flows.cli import main
from grpo_flow.flows.evaluate import (
    EvalSettings,
    EvaluationError,
    evaluate,
    pass_at_k,
    pass_k_values,
    read_eval_summary,
    resolve_checkpoint,
    summarize,
    write_once,
)
from grpo_flow.schemas.presets import preset_config
from grpo_flow.tasks.observability import artifact_key
from grpo_flow.workers.state.storage import RunStorage
from grpo_flow.workers.state.faults import injected

SMALL = dict(prompts_per_step=8, num_generations=4, num_rollout_workers=2, eval_prompts=0)


# -- pass@k ------------------------------------------------------------------------------------------
def brute_force_pass_at_k(n: int, c: int, k: int) -> float:
    """The definition: the share of k-subsets of the n samples holding at least one correct one."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in subset) for subset in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_is_the_unbiased_estimator(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(n, c, k), abs=1e-12)
            assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)


def test_pass_at_k_edges_and_bad_input():
    assert pass_at_k(200, 0, 10) == 0.0 and pass_at_k(200, 200, 1) == 1.0
    assert pass_at_k(200, 3, 1) == pytest.approx(3 / 200)  # pass@1 is the plain sampled accuracy
    assert 0.0 < pass_at_k(1000, 1, 100) < 1.0  # no overflow where C(n, k) is astronomically large
    for n, c, k in [(4, 5, 1), (4, 1, 0), (4, 1, 5), (4, -1, 1)]:
        with pytest.raises(ValueError):
            pass_at_k(n, c, k)
    assert pass_k_values(8) == [1, 2, 4, 8] and pass_k_values(6) == [1, 2, 4, 6] and pass_k_values(1) == [1]


def test_summarize_averages_per_prompt():
    settings = EvalSettings(k=2, prompts=2, temperature=1.0, top_p=1.0, max_tokens=2, seed=0, greedy=True)
    rows = [
        {"mode": "sample", "prompt_id": "a", "correct": True, "reward": 1.0, "completion_tokens": 2},
        {"mode": "sample", "prompt_id": "a", "correct": False, "reward": 0.0, "completion_tokens": 4},
        {"mode": "sample", "prompt_id": "b", "correct": False, "reward": 0.0, "completion_tokens": 2},
        {"mode": "sample", "prompt_id": "b", "correct": False, "reward": None, "completion_tokens": 2},
        {"mode": "greedy", "prompt_id": "a", "correct": True, "reward": 1.0, "completion_tokens": 9},
        {"mode": "greedy", "prompt_id": "b", "correct": False, "reward": 0.0, "completion_tokens": 9},
    ]
    metrics = summarize(rows, settings)
    assert metrics["pass@1"] == pytest.approx((0.5 + 0.0) / 2)
    assert metrics["pass@2"] == pytest.approx((1.0 + 0.0) / 2)
    assert metrics["greedy_accuracy"] == 0.5
    assert metrics["mean_reward"] == pytest.approx(1 / 3)  # null rewards left out; greedy rows too
    assert metrics["mean_completion_length"] == 2.5


def test_an_eval_file_is_never_overwritten(tmp_path):
    path = tmp_path / "eval" / "step-000001.parquet"
    write_once(path, pa.table({"x": [1]}))
    with pytest.raises(FileExistsError, match="never overwritten"):
        write_once(path, pa.table({"x": [2]}))
    assert pq.read_table(path)["x"].to_pylist() == [1]
    assert [p.name for p in path.parent.iterdir()] == ["step-000001.parquet"]  # no temporary file left


# -- the flow on real checkpoints ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def eval_root(prefect_server, storage_root, tmp_path_factory, monkeypatch_module):
    """Its own storage root (the nightly sweep takes every run under it) holding run `evaluated`
    (checkpoints 1 and 2, wandb offline) and run `no-checkpoint` (failed in step 1)."""
    from grpo_flow.flows.grpo import grpo
    from grpo_flow.workers.data.tiny_model import ensure_tiny_model

    root = tmp_path_factory.mktemp("eval-root")
    wandb_dir = tmp_path_factory.mktemp("wandb")
    monkeypatch_module.setenv("WANDB_MODE", "offline")
    monkeypatch_module.setenv("WANDB_DIR", str(wandb_dir))
    monkeypatch_module.setenv("WANDB_SILENT", "true")
    model = str(ensure_tiny_model(storage_root))  # the session's tiny model, built once
    grpo(
        preset_config(
            "tiny",
            model=model,
            run_id="evaluated",
            storage_root=str(root),
            max_steps=2,
            save_steps=1,
            report_to="wandb",
            wandb_project="grpo-flow-tests",
            **SMALL,
        )
    )
    with pytest.raises(Exception, match="injected failure"), injected("generate@1"):
        grpo(
            preset_config(
                "tiny",
                model=model,
                run_id="no-checkpoint",
                storage_root=str(root),
                max_steps=2,
                generate_retries=0,
                **SMALL,
            )
        )
    return root, wandb_dir


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def read_artifacts(key: str) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        return client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))


def test_the_grpo_flow_makes_a_step_artifact_per_step_and_a_progress_artifact(eval_root):
    """The fixture's runs, as the Prefect API shows them: a markdown version per step with the
    step's metrics and three of its logged completions; progress at 100 % when done, at 0 % for
    the run that failed in step 1."""
    root, _ = eval_root
    steps = sorted(read_artifacts("grpo-step-evaluated"), key=lambda a: a.created)
    assert [a.type for a in steps] == ["markdown", "markdown"]
    logged = RunStorage(root, "evaluated").read_rollouts(2).to_pylist()
    newest = steps[-1].data
    assert "step 2" in newest and "step 1" in steps[0].data
    reward = RunStorage(root, "evaluated").read_metrics().to_pylist()[-1]["reward"]
    assert f"| reward | {reward:.6g} |" in newest and "| loss |" in newest
    assert newest.count("Completion:") == 3 and "(last_digit " in newest
    best = max(logged, key=lambda r: r["reward"])  # the first sample shown is the best by reward
    assert f"**1. reward {best['reward']:.6g}** (last_digit {best['reward_last_digit']:.6g})" in newest
    (progress,) = read_artifacts("grpo-progress-evaluated")
    assert progress.type == "progress" and float(progress.data) == 100.0 and progress.description == "step 2 / 2"
    (failed,) = read_artifacts("grpo-progress-no-checkpoint")
    assert float(failed.data) == 0.0 and failed.description == "step 0 / 2"
    assert not read_artifacts("grpo-step-no-checkpoint")


def test_evaluate_a_named_checkpoint(eval_root):
    root, wandb_dir = eval_root
    summary = evaluate(run_id="evaluated", storage_root=str(root), checkpoint=1, k=4, prompts=8)
    path = RunStorage(root, "evaluated").eval_path(1)
    assert summary["path"] == str(path) and not summary["already_evaluated"]
    table = pq.read_table(path)
    assert table.num_rows == 8 * 4 + 8  # k samples per prompt, and one greedy completion each
    rows = table.to_pylist()
    sampled = [r for r in rows if r["mode"] == "sample"]
    assert {r["prompt_id"] for r in sampled} == {f"last_digit-heldout-{i:05d}" for i in range(8)}
    assert all(r["correct"] == (r["completion"].strip() == r["answer"]) for r in rows)
    assert all(r["reward"] == r["reward_last_digit"] for r in rows)
    assert summary["pass@1"] == pytest.approx(sum(r["correct"] for r in sampled) / len(sampled))
    assert 0 <= summary["pass@1"] <= summary["pass@2"] <= summary["pass@4"] <= 1
    assert summary["mean_completion_length"] == pytest.approx(sum(r["completion_tokens"] for r in sampled) / 32)
    stored = read_eval_summary(path)
    assert {k: v for k, v in summary.items() if k != "already_evaluated"} == stored
    versions = read_artifacts(artifact_key("eval", "evaluated"))
    assert versions and all(a.type == "table" for a in versions)
    assert any('"checkpoint_step": 1' in a.data for a in versions)
    # The run reports to wandb: the evaluation went to its wandb run (offline files hold the keys).
    logged = b"".join(p.read_bytes() for p in wandb_dir.glob("wandb/offline-run-*-evaluated/*.wandb"))
    assert b"eval/pass@1" in logged and b"eval/checkpoint_step" in logged


def test_an_evaluated_checkpoint_is_read_back_not_measured_again(eval_root):
    root, _ = eval_root
    path = RunStorage(root, "evaluated").eval_path(1)
    if not path.exists():
        evaluate(run_id="evaluated", storage_root=str(root), checkpoint=1, k=4, prompts=8)
    before = (path.read_bytes(), path.stat().st_mtime_ns)
    again = evaluate(run_id="evaluated", storage_root=str(root), checkpoint=1, k=2, prompts=4)
    assert again["already_evaluated"] and again["samples_per_prompt"] == 4  # the stored evaluation
    assert (path.read_bytes(), path.stat().st_mtime_ns) == before


def test_nightly_evaluates_runs_with_a_newer_checkpoint_and_skips_the_rest(eval_root):
    root, _ = eval_root
    storage = RunStorage(root, "evaluated")
    if not storage.evaluated_steps():
        evaluate(run_id="evaluated", storage_root=str(root), checkpoint=1, k=4, prompts=8)
    outcome = evaluate(storage_root=str(root), k=2, prompts=4, greedy=False)  # checkpoint 2 > evaluated 1
    assert set(outcome["evaluated"]) == {"evaluated"} and outcome["evaluated"]["evaluated"]["checkpoint_step"] == 2
    assert outcome["skipped"] == {"no-checkpoint": "no valid checkpoint"} and outcome["failed"] == {}
    assert storage.evaluated_steps() == [1, 2]
    assert pq.read_table(storage.eval_path(2)).num_rows == 4 * 2  # no greedy rows when greedy=False
    assert math.isnan(read_eval_summary(storage.eval_path(2))["greedy_accuracy"])
    again = evaluate(storage_root=str(root), k=2, prompts=4)
    assert again["evaluated"] == {} and "not newer than its last evaluation (2)" in again["skipped"]["evaluated"]
    (sweep, *_) = read_artifacts("evaluate-nightly")
    assert sweep.type == "table" and "skipped" in sweep.data


def test_checkpoint_resolution_and_cli_refusals(eval_root, capsys):
    root, _ = eval_root
    storage = RunStorage(root, "evaluated")
    assert resolve_checkpoint(storage, None) == 2 and resolve_checkpoint(storage, 1) == 1
    with pytest.raises(EvaluationError, match="no checkpoint of step 9"):
        resolve_checkpoint(storage, 9)
    with pytest.raises(EvaluationError, match="no valid checkpoint"):
        resolve_checkpoint(RunStorage(root, "no-checkpoint"), None)
    with pytest.raises(EvaluationError, match="needs run_id"):
        evaluate.fn(storage_root=str(root), checkpoint=1)
    for argv, message in [
        (["eval", "nope"], "RUN: no run 'nope'"),
        (["eval", "evaluated", "--checkpoint", "9"], "--checkpoint: run 'evaluated' has no checkpoint of step 9"),
        (["eval", "no-checkpoint"], "RUN: run 'no-checkpoint' has no valid checkpoint"),
        (["eval", "evaluated", "--k", "0"], "--k: must be at least 1"),
    ]:
        assert main([*argv, "--storage-root", str(root)]) == 2
        assert message in capsys.readouterr().err


def test_grpo_eval_prints_the_summary(eval_root, capsys):
    root, _ = eval_root
    assert (
        main(["eval", "evaluated", "--checkpoint", "1", "--k", "4", "--prompts", "8", "--storage-root", str(root)]) == 0
    )
    out = capsys.readouterr().out
    assert "pass@4" in out and "greedy accuracy" in out and "step-000001.parquet" in out


# -- runs on the Modal backend: the checkpoint's weights are on the Volume ------------------------------------
class FakeVolume:
    """modal.Volume's read_file (chunks of bytes by path relative to the Volume root), counting reads."""

    def __init__(self, files: dict[str, bytes]):
        self.files, self.reads = files, 0

    def read_file(self, path: str):
        self.reads += 1
        data = self.files[path]
        yield from (data[i : i + 1000] for i in range(0, len(data), 1000))


def as_modal_checkpoint(run_dir, step: int) -> FakeVolume:
    """Make a local checkpoint look like one the Modal actor wrote: its model's files (model/, or a LoRA
    run's adapter/ and base_model.json) on the Volume, a pointer in the folder, the manifest listing what is
    left (as RemoteActor.save_checkpoint does)."""
    import json
    import shutil

    from grpo_flow.workers.backends.modal_app import VOLUME_PATH
    from grpo_flow.workers.backends.modal_backend import MODEL_FILES, VOLUME_CHECKPOINT_POINTER
    from grpo_flow.workers.state.storage import MANIFEST, file_manifest

    folder = run_dir / "checkpoints" / f"step-{step:06d}"
    remote = f"runs/{run_dir.name}/checkpoints/step-{step:06d}"
    pointer_files = {name: spec for name, spec in file_manifest(folder).items() if name.startswith(MODEL_FILES)}
    files = {f"{remote}/{name}": (folder / name).read_bytes() for name in pointer_files}
    for top in {name.split("/")[0] for name in pointer_files}:
        if (folder / top).is_dir():
            shutil.rmtree(folder / top)
        else:
            (folder / top).unlink()
    pointer = {"volume": "grpo-test-volume", "path": f"{VOLUME_PATH}/{remote}", "files": pointer_files}
    (folder / VOLUME_CHECKPOINT_POINTER).write_text(json.dumps(pointer))
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["files"] = {name: spec for name, spec in file_manifest(folder).items() if name != MANIFEST}
    (folder / MANIFEST).write_text(json.dumps(manifest))
    return FakeVolume(files)


def test_a_modal_runs_checkpoint_is_fetched_from_its_volume_checked_and_evaluated_the_same(
    eval_root, tmp_path, monkeypatch
):
    import shutil

    import grpo_flow.workers.backends.modal_backend as modal_backend

    root, _ = eval_root
    local_root, modal_root = tmp_path / "local-root", tmp_path / "modal-root"
    for copy in (local_root, modal_root):  # the run as trained, without its evaluations
        shutil.copytree(root / "runs" / "evaluated", copy / "runs" / "evaluated", ignore=shutil.ignore_patterns("eval"))
    reference = evaluate(run_id="evaluated", storage_root=str(local_root), checkpoint=2, k=2, prompts=4)
    assert not reference["already_evaluated"]
    run_dir = modal_root / "runs" / "evaluated"
    volume = as_modal_checkpoint(run_dir, 2)
    opened = []
    monkeypatch.setattr(modal_backend, "open_volume", lambda name: opened.append(name) or volume)
    before = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*"))

    summary = evaluate(run_id="evaluated", storage_root=str(modal_root), checkpoint=2, k=2, prompts=4)
    assert opened == ["grpo-test-volume"] and volume.reads == len(volume.files)
    same = {"pass@1", "pass@2", "mean_reward", "mean_completion_length"}
    assert {k: summary[k] for k in same} == {k: reference[k] for k in same}  # the same weights, the same seed
    cached = modal_root / "cache" / "volume-checkpoints" / "grpo-test-volume" / "runs" / "evaluated"
    assert (cached / "checkpoints" / "step-000002" / "model" / "config.json").exists()
    # Only the eval file was added to the run's folder; the weights went to the cache.
    added = sorted(set(p.relative_to(run_dir) for p in run_dir.rglob("*")) - set(before))
    assert all(str(p).startswith("eval") for p in added) and added

    # A second look downloads nothing: the cached files match the pointer.
    from grpo_flow.workers.backends.modal_backend import checkpoint_model_files

    assert (checkpoint_model_files(run_dir / "checkpoints" / "step-000002", modal_root / "cache") / "model").is_dir()
    assert volume.reads == len(volume.files)


def test_a_volume_file_that_no_longer_matches_its_pointer_is_refused(eval_root, tmp_path, monkeypatch):
    import shutil

    import grpo_flow.workers.backends.modal_backend as modal_backend
    from grpo_flow.workers.backends.modal_backend import checkpoint_model_files

    root, _ = eval_root
    shutil.copytree(root / "runs" / "evaluated", tmp_path / "runs" / "evaluated", ignore=shutil.ignore_patterns("eval"))
    volume = as_modal_checkpoint(tmp_path / "runs" / "evaluated", 1)
    name = next(n for n in volume.files if n.endswith("config.json"))
    volume.files[name] = volume.files[name] + b" "
    monkeypatch.setattr(modal_backend, "open_volume", lambda _: volume)
    with pytest.raises(ValueError, match=r"model/config.json of checkpoint .* does not match its pointer"):
        checkpoint_model_files(tmp_path / "runs" / "evaluated" / "checkpoints" / "step-000001", tmp_path / "cache")
    assert not list((tmp_path / "cache").rglob("config.json*"))  # nothing half-written is left to be trusted


def test_grpo_eval_of_an_evaluated_checkpoint_shows_the_stored_result_without_loading_a_model(eval_root):
    """Reported: 21 s to show what was already on disk. A fresh `grpo` process prints the stored
    figures without importing torch, transformers or Prefect; --force evaluates again, and the earlier
    file is moved aside, never deleted."""
    import subprocess
    import sys

    root, _ = eval_root
    storage = RunStorage(root, "evaluated")
    path = storage.eval_path(1)
    if not path.exists():
        evaluate(run_id="evaluated", storage_root=str(root), checkpoint=1, k=4, prompts=8)
    stored = read_eval_summary(path)
    code = (
        "import sys\nfrom grpo_flow.flows.cli import main\nrc = main(sys.argv[1:])\n"
        "print('loaded:', [m for m in ('torch', 'transformers', 'prefect') if m in sys.modules])\nsys.exit(rc)\n"
    )
    argv = [sys.executable, "-c", code, "eval", "evaluated", "--checkpoint", "1", "--storage-root", str(root)]
    shown = subprocess.run(argv + ["--k", "2"], capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert f"{stored['pass@1']:.4f}" in shown.stdout and "--force evaluates again" in shown.stdout
    assert "loaded: []" in shown.stdout
    assert f"note: stored with k={stored['setting_k']}, you asked k=2" in shown.stdout

    forced = main(
        ["eval", "evaluated", "--checkpoint", "1", "--k", "2", "--prompts", "4", "--force"]
        + ["--storage-root", str(root)]
    )
    assert forced == 0
    assert read_eval_summary(path)["samples_per_prompt"] == 2  # measured again, with the options given
    (earlier,) = (path.parent / "superseded").glob("step-000001.*.parquet")
    assert read_eval_summary(earlier) == stored


def test_a_forced_evaluation_that_fails_leaves_the_stored_one_in_place(eval_root, monkeypatch):
    import grpo_flow.flows.evaluate as evaluate_module

    root, _ = eval_root
    path = RunStorage(root, "evaluated").eval_path(2)
    if not path.exists():
        evaluate(run_id="evaluated", storage_root=str(root), checkpoint=2, k=2, prompts=4)
    stored, earlier = path.read_bytes(), set(path.parent.glob("superseded/step-000002.*"))

    def no_engine(*args, **kwargs):
        raise RuntimeError("the checkpoint's engine did not start")

    monkeypatch.setattr(evaluate_module, "checkpoint_engine", no_engine)
    with pytest.raises(RuntimeError, match="did not start"):
        evaluate(run_id="evaluated", storage_root=str(root), checkpoint=2, k=2, prompts=4, force=True)
    assert path.read_bytes() == stored  # where grpo eval and the nightly sweep read it
    assert set(path.parent.glob("superseded/step-000002.*")) == earlier


def test_grpo_eval_refuses_what_it_cannot_evaluate_in_one_line(eval_root, tmp_path, monkeypatch, capsys, caplog):
    """A run that holds out no prompts, and one whose rewards do not import here, get exit 2 and one line,
    not the evaluation task's tracebacks."""
    import json
    import logging
    import sys

    from grpo_flow.flows.grpo import grpo
    from grpo_flow.schemas.config import GRPOFlowConfig
    from grpo_flow.workers.data.tiny_model import ensure_tiny_model

    root, _ = eval_root
    (tmp_path / "data.jsonl").write_text(
        "".join(
            json.dumps({"prompt": f"{1000 + 37 * i}=", "answer": str((1000 + 37 * i) % 10)}) + "\n" for i in range(20)
        )
    )
    (tmp_path / "eval_cli_rewards.py").write_text(
        "def exact(completions, answer, **kwargs):\n    return [0.0] * len(completions)\n"
    )
    monkeypatch.chdir(tmp_path)
    config = GRPOFlowConfig(
        model=str(ensure_tiny_model(root)),
        dataset=f"hf:{tmp_path / 'data.jsonl'}",
        reward_funcs=["eval_cli_rewards:exact"],
        run_id="unscored",
        storage_root=str(root),
        max_steps=1,
        save_steps=1,
        prompts_per_step=4,
        num_generations=2,
        max_completion_length=2,
    )
    caplog.set_level(logging.INFO, logger="grpo_flow.phase")
    assert grpo(config)["status"] == "completed"
    assert not [r for r in caplog.records if "held-out prompts" in r.getMessage()]  # none held out: none announced
    capsys.readouterr()
    assert main(["eval", "unscored", "--storage-root", str(root)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("grpo eval: RUN: run 'unscored' holds out no prompts") and err.count("\n") == 1, err

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.delitem(sys.modules, "eval_cli_rewards")
    monkeypatch.setattr(sys, "path", [entry for entry in sys.path if entry != str(tmp_path)])  # as a new process
    assert main(["eval", "unscored", "--storage-root", str(root)]) == 2
    err = capsys.readouterr().err
    assert "RUN: run 'unscored': reward_funcs: cannot import 'eval_cli_rewards:exact'" in err and err.count("\n") == 1

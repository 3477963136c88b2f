"""The `grpo` flow on a `memory://` storage root (fsspec's in-process object store): the storage layer's
contract under a real run, fast enough for the unit tier. The S3 runs are in test_object_store_cli.py."""

import os

from grpo_flow.flows.grpo import grpo
from grpo_flow.schemas.presets import preset_config
from grpo_flow.workers.state.storage import RunStorage
from grpo_flow.workers.state.verify import verify_run

SMALL = dict(prompts_per_step=4, num_generations=4, num_rollout_workers=2, eval_prompts=0, save_steps=1)


def test_a_run_on_an_object_store_logs_checkpoints_and_resumes_from_it(
    prefect_server, storage_root, monkeypatch, tmp_path
):
    monkeypatch.setenv("GRPO_FLOW_CACHE", str(storage_root))  # the session's tiny model, built once
    monkeypatch.chdir(tmp_path)
    root = "memory://grpo-flow-test/root"
    config = preset_config("tiny", run_id="on-memory", storage_root=root, max_steps=2, **SMALL)
    assert grpo(config)["status"] == "completed"
    storage = RunStorage(root, "on-memory")
    assert storage.rollout_steps() == [1, 2] and storage.complete_checkpoints() == [1, 2]

    resumed = grpo(config.model_copy(update={"max_steps": 3}))  # restores checkpoint 2 from the store
    assert resumed["resumed_from_step"] == 2 and resumed["steps_completed"] == 3
    assert storage.rollout_steps() == [1, 2, 3] and storage.logged_steps() == [1, 2, 3]
    assert storage.read_rollouts().num_rows == 3 * 4 * 4
    check = verify_run(storage)
    assert check.clean and check.checkpoints == [1, 2, 3] and check.leftovers == []
    assert os.listdir(tmp_path) == []  # nothing in a local folder named after the URL


def test_deployments_take_a_url_storage_root_as_it_is():
    from grpo_flow.deployments.serve import build_deployments

    deployments = build_deployments("s3://bucket/grpo", None, None, None, None)
    assert {d.parameters["storage_root"] for d in deployments} == {"s3://bucket/grpo"}


def test_storage_options_that_are_not_a_json_object_are_refused_naming_the_option(capsys):
    from grpo_flow.flows.cli import main

    assert main(["train", "--storage-root", "memory://grpo-flow-test/options", "--storage-options", "[1]"]) == 2
    assert "grpo train: --storage-options: '[1]' is not a JSON object" in capsys.readouterr().err

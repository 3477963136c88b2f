"""The deployments: how parameters override a preset, the nightly schedule, the presets behind them.

What a Prefect server does with a deployment run's parameters is reproduced here with
Prefect's own code: the CLI's `--param` parsing (`load_json_key_values`), the server's shallow
merge over the deployment's parameters, and its check against the parameter schema
(`schema_tools.validate`). tests/flows/test_real_server.py runs the same path for real.
"""

import json
import os
import subprocess
import sys

import pytest
from prefect.cli._utilities import load_json_key_values
from prefect.utilities.schema_tools import validate
from prefect.utilities.schema_tools.validation import ValidationError as SchemaValidationError

from grpo_flow.deployments.grpo import (
    DeploymentConfigError,
    check_auto_resume_limit,
    grpo_preset,
    resolve_config,
    split_parameters,
)
from grpo_flow.deployments.serve import DeploymentSettingsError, build_deployments, nightly_schedule
from grpo_flow.schemas.config import GRPOFlowConfig
from grpo_flow.schemas.presets import PRESETS, preset_config
from grpo_flow.workers.state.storage import RunStorage


def schema() -> dict:
    return grpo_preset.parameters.model_dump()


def deployment_run_parameters(deployment_parameters: dict, *cli_params: str) -> dict:
    """What the server hands the flow for `prefect deployment run NAME --param k=v ...`."""
    given = load_json_key_values(list(cli_params), "parameter")  # the CLI: each value read as JSON
    merged = {**deployment_parameters, **given}  # the server: shallow merge (server/api/deployments.py)
    validate(merged, schema(), raise_on_error=True)  # the server: enforce_parameter_schema
    return merged


# -- parameters ----------------------------------------------------------------------------------------
def test_every_config_field_is_a_deployment_parameter():
    properties = schema()["properties"]
    assert set(GRPOFlowConfig.model_fields) <= set(properties)
    assert {"preset", "config", "allow_config_change", "fail_at"} <= set(properties)
    assert set(properties["preset"]["enum"]) == set(PRESETS)
    assert grpo_preset.name == "grpo"  # so the deployments read grpo/<preset>
    # A field's description and constraints reach the schema (the UI form; the server's check).
    assert "Completions sampled per prompt" in properties["num_generations"]["description"]
    assert {"minimum": 2, "type": "integer"} in properties["num_generations"]["anyOf"]


def test_single_params_override_one_field_of_the_preset(tmp_path):
    parameters = deployment_run_parameters(
        {"preset": "tiny", "storage_root": str(tmp_path)},
        "max_steps=3",
        "prompts_per_step=8",
        "num_generations=4",
        "run_id=dep-1",
        "learning_rate=1e-3",
    )
    preset, overrides, allow, fail_at = split_parameters(parameters)
    config = resolve_config(preset, overrides)
    expected = preset_config(
        "tiny",
        max_steps=3,
        prompts_per_step=8,
        num_generations=4,
        run_id="dep-1",
        learning_rate=1e-3,
        storage_root=str(tmp_path),
    )
    assert config == expected  # every other field is the preset's
    assert (allow, fail_at) == (False, None)


def test_a_config_object_merges_over_the_preset_and_wins_over_single_fields(tmp_path):
    parameters = deployment_run_parameters(
        {"preset": "gsm8k", "storage_root": str(tmp_path)},
        'config={"max_steps": 7, "epsilon_high": null, "storage_root": "elsewhere"}',
        "max_steps=3",
        "fail_at=score@2",
    )
    preset, overrides, _, fail_at = split_parameters(parameters)
    config = resolve_config(preset, overrides)
    assert config.max_steps == 7 and config.storage_root == "elsewhere" and config.epsilon_high is None
    assert config.model == PRESETS["gsm8k"]["model"] and fail_at == "score@2"
    # A whole config as `config` (the grpo flow's own parameter shape) works the same way.
    whole = preset_config("tiny", max_steps=2, run_id="whole").model_dump(mode="json")
    parameters = deployment_run_parameters({"preset": "tiny"}, f"config={json.dumps(whole)}")
    preset, overrides, _, _ = split_parameters(parameters)
    assert resolve_config(preset, overrides) == GRPOFlowConfig(**whole)


@pytest.mark.parametrize(
    "param",
    ["max_steps=abc", "preset=nope", 'run_id="bad id!"', "num_generations=1", "loss_type=ppo", "run_id=123"],
)
def test_the_server_refuses_bad_types_before_a_run_is_created(param):
    with pytest.raises(SchemaValidationError):
        deployment_run_parameters({"preset": "tiny"}, param)


def test_bad_values_fail_the_run_naming_the_field(tmp_path):
    with pytest.raises(
        DeploymentConfigError,
        match=r"^invalid config: prompts_per_step/num_rollout_workers: prompts_per_step \(6\) must split",
    ):
        resolve_config("tiny", {"prompts_per_step": 6, "num_rollout_workers": 4})
    with pytest.raises(DeploymentConfigError, match=r"^invalid config: max_steps: Input should be a valid integer"):
        resolve_config("tiny", {"max_steps": "abc"})
    with pytest.raises(DeploymentConfigError, match="unknown fields"):
        resolve_config("tiny", {"max_step": 3})
    with pytest.raises(DeploymentConfigError, match="unknown preset"):
        resolve_config("huge", {})


def test_an_existing_run_id_resumes_from_the_runs_own_config(tmp_path):
    stored = preset_config("tiny", run_id="old", storage_root=str(tmp_path), learning_rate=1e-2, max_steps=4)
    RunStorage(tmp_path, "old").write_config(stored.model_dump(mode="json"))
    config = resolve_config("gsm8k", {"run_id": "old", "storage_root": str(tmp_path), "max_steps": 6})
    assert config.learning_rate == 1e-2 and config.model == "tiny" and config.max_steps == 6  # not gsm8k's
    with pytest.raises(DeploymentConfigError, match="would change fields that alter training"):
        resolve_config("tiny", {"run_id": "old", "storage_root": str(tmp_path), "learning_rate": 1e-4})
    allowed = resolve_config("tiny", {"run_id": "old", "storage_root": str(tmp_path), "learning_rate": 1e-4}, True)
    assert allowed.learning_rate == 1e-4


def test_a_run_started_by_the_resume_automation_stops_at_its_limit(tmp_path):
    storage = RunStorage(tmp_path, "again")
    storage.write_config(preset_config("tiny", run_id="again", storage_root=str(tmp_path)).model_dump(mode="json"))
    config = resolve_config("tiny", {"run_id": "again", "storage_root": str(tmp_path)})
    check_auto_resume_limit(config, 2)  # never resumed: it may be
    check_auto_resume_limit(config, None)  # not started by the automation
    storage.write_resume({"step": 1})
    storage.write_resume({"step": 2})
    with pytest.raises(DeploymentConfigError, match=r"^auto_resume_limit: run again was resumed 2 times already"):
        check_auto_resume_limit(config, 2)


def test_a_server_that_cannot_create_automations_gets_a_one_line_warning():
    """A server without the automations API (an old one; here, one that answers 404 to everything)."""
    import http.server
    import threading

    from prefect.settings import PREFECT_API_URL, temporary_settings

    from grpo_flow.deployments.automations import set_up_automations

    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_error(404)

        do_POST = do_PUT = do_DELETE = do_GET

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with temporary_settings(updates={PREFECT_API_URL: f"http://127.0.0.1:{server.server_port}/api"}):
            warning = set_up_automations(True, 3)
    finally:
        server.shutdown()
    assert warning is not None and "\n" not in warning
    assert warning.startswith("could not set up automation grpo-resume (") and "404" in warning
    assert warning.endswith("runs are neither resumed nor guarded automatically")


def test_storage_root_falls_back_to_the_environment(monkeypatch):
    monkeypatch.setenv("GRPO_FLOW_STORAGE", "/data/grpo")
    assert split_parameters({"preset": "tiny"})[1] == {"storage_root": "/data/grpo"}
    assert split_parameters({"preset": "tiny", "storage_root": "/x"})[1] == {"storage_root": "/x"}


@pytest.mark.slow
def test_the_wrapper_runs_the_grpo_flow_under_the_run_id(prefect_server, storage_root, tmp_path):
    from prefect.client.orchestration import get_client
    from grpo_flow.workers.data.tiny_model import ensure_tiny_model

    model = str(ensure_tiny_model(storage_root))  # built once per session; this test's runs are its own
    summary = grpo_preset(
        preset="tiny",
        model=model,
        max_steps=2,
        prompts_per_step=8,
        num_generations=4,
        eval_prompts=0,
        storage_root=str(tmp_path),
    )
    assert summary["status"] == "completed" and summary["steps_completed"] == 2
    run_id = summary["run_id"]  # generated: the flow run was renamed after it
    assert RunStorage(tmp_path, run_id).logged_steps() == [1, 2]
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[run_id, f"{run_id}-step-1"]))
        )
    by_name = {run.name: run for run in runs}
    assert run_id in by_name and by_name[run_id].state.is_completed()
    assert f"{run_id}-step-1" in by_name  # the step subflows hang under the deployment's flow run


# -- deployments and schedule ----------------------------------------------------------------------------
def test_build_deployments_names_entrypoints_parameters_and_schedule(tmp_path):
    deployments = {d.name: d for d in build_deployments(tmp_path / "store", timezone="Europe/Berlin", k=4)}
    assert set(deployments) == {"tiny", "smol-math", "gsm8k", "math", "mbpp", "nightly", "checkpoint"}
    for preset in ("tiny", "smol-math", "gsm8k", "math", "mbpp"):
        deployment = deployments[preset]
        assert deployment.flow_name == "grpo" and deployment.entrypoint == "grpo_flow.deployments.grpo.grpo_preset"
        assert deployment.parameters == {"preset": preset, "storage_root": str((tmp_path / "store").absolute())}
        assert not deployment.schedules
    nightly = deployments["nightly"]
    assert nightly.flow_name == "evaluate" and nightly.entrypoint == "grpo_flow.flows.evaluate.evaluate"
    assert nightly.parameters == {"storage_root": str((tmp_path / "store").absolute()), "k": 4}
    (schedule,) = nightly.schedules
    assert (schedule.schedule.cron, schedule.schedule.timezone) == ("0 2 * * *", "Europe/Berlin")


def test_evaluate_checkpoint_runs_on_each_saved_checkpoint_of_a_deployment_run(tmp_path):
    """The trigger's parameters as the server renders them from a `grpo.checkpoint.saved` (Prefect's own
    template upgrade and hydration), then checked against the evaluate flow's schema as the server does."""
    from prefect.server.events.actions import RunDeployment
    from prefect.utilities.schema_tools.hydration import HydrationContext, hydrate

    from grpo_flow.flows.evaluate import evaluate

    store = str((tmp_path / "store").absolute())
    deployments = {d.name: d for d in build_deployments(tmp_path / "store", k=4)}
    checkpoint = deployments["checkpoint"]
    assert checkpoint.flow_name == "evaluate" and checkpoint.concurrency_limit == 1
    assert checkpoint.parameters == {"storage_root": store, "k": 4}
    (trigger,) = checkpoint.triggers
    assert trigger.expect == {"grpo.checkpoint.saved"}
    assert trigger.match_related.model_dump() == {"prefect.resource.role": "deployment"}
    event = {"payload": {"step": 20, "path": "/x", "policy_version": 20, "run_id": "r1", "storage_root": "s3://b/g"}}
    parameters = dict(trigger.parameters)
    RunDeployment._upgrade_v1_templates(parameters)
    rendered = hydrate(
        parameters, HydrationContext(raise_on_error=True, render_jinja=True, jinja_context={"event": event})
    )
    assert rendered == {"storage_root": "s3://b/g", "k": 4, "run_id": "r1", "checkpoint": 20}
    validate(rendered, evaluate.parameters.model_dump(), raise_on_error=True)
    quiet = {d.name: d for d in build_deployments(tmp_path / "store", evaluate_checkpoints=False)}
    assert quiet["checkpoint"].triggers == []


def test_serves_kl_limit_is_each_grpo_deployments_guard_max_kl(tmp_path):
    deployments = {d.name: d for d in build_deployments(tmp_path / "store", max_kl=0.5)}
    for preset in ("tiny", "smol-math", "gsm8k", "math", "mbpp"):
        assert deployments[preset].parameters["guard_max_kl"] == 0.5
    merged = deployment_run_parameters(deployments["tiny"].parameters, "run_id=guarded")
    assert merged["guard_max_kl"] == 0.5  # the server's schema takes it
    assert "guard_max_kl" not in build_deployments(tmp_path / "store")[0].parameters


def test_nightly_schedule_from_options_environment_and_defaults(monkeypatch):
    monkeypatch.delenv("GRPO_FLOW_NIGHTLY_TZ", raising=False)
    monkeypatch.delenv("GRPO_FLOW_NIGHTLY_CRON", raising=False)
    assert nightly_schedule() == ("0 2 * * *", "UTC")
    monkeypatch.setenv("GRPO_FLOW_NIGHTLY_TZ", "America/New_York")
    monkeypatch.setenv("GRPO_FLOW_NIGHTLY_CRON", "30 3 * * 1-5")
    assert nightly_schedule() == ("30 3 * * 1-5", "America/New_York")
    assert nightly_schedule("0 4 * * *", "Asia/Tokyo") == ("0 4 * * *", "Asia/Tokyo")
    with pytest.raises(DeploymentSettingsError, match="--timezone: 'Mars/Olympus' is not an IANA"):
        nightly_schedule(timezone="Mars/Olympus")
    with pytest.raises(DeploymentSettingsError, match="--nightly-cron: 'at two' is not a valid cron"):
        nightly_schedule(cron="at two")


def test_entrypoints_load_from_any_working_directory(tmp_path, monkeypatch):
    from prefect.flows import load_flow_from_entrypoint

    monkeypatch.chdir(tmp_path)
    loaded = load_flow_from_entrypoint("grpo_flow.deployments.grpo.grpo_preset")
    assert loaded.name == "grpo" and set(loaded.parameters.properties) == set(schema()["properties"])
    assert load_flow_from_entrypoint("grpo_flow.flows.evaluate.evaluate").name == "evaluate"


@pytest.mark.parametrize(
    "args, env, expected",
    [
        (["serve"], {}, "needs a Prefect server"),
        (
            ["serve", "--timezone", "Mars/Olympus"],
            {"PREFECT_API_URL": "http://127.0.0.1:9/api"},
            "grpo serve: --timezone: 'Mars/Olympus' is not an IANA time zone",
        ),
        (
            ["serve", "--nightly-cron", "daily"],
            {"PREFECT_API_URL": "http://127.0.0.1:9/api"},
            "grpo serve: --nightly-cron: 'daily' is not a valid cron",
        ),
        (["serve", "--eval-k", "0"], {"PREFECT_API_URL": "http://127.0.0.1:9/api"}, "--eval-k: must be at least 1"),
        (
            ["serve", "--max-auto-resumes", "0"],
            {"PREFECT_API_URL": "http://127.0.0.1:9/api"},
            "grpo serve: --max-auto-resumes: must be at least 1, got 0",
        ),
        (
            ["serve", "--max-kl", "0"],
            {"PREFECT_API_URL": "http://127.0.0.1:9/api"},
            "grpo serve: --max-kl: must be above 0, got 0.0",
        ),
        (
            ["serve", "--max-kl", "abc"],
            {"PREFECT_API_URL": "http://127.0.0.1:9/api"},
            "grpo serve: error: argument --max-kl: invalid float value: 'abc'",
        ),
        (
            ["serve", "--gpu-slots", "-1"],
            {"PREFECT_API_URL": "http://127.0.0.1:9/api"},
            "grpo serve: --gpu-slots: must be 0 (no limit) or more, got -1",
        ),
    ],
)
def test_serve_refuses_bad_input_before_registering_anything(tmp_path, args, env, expected):
    environment = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    environment.update(PREFECT_HOME=str(tmp_path / "home"), **env)  # a profile without an API URL
    done = subprocess.run(
        [sys.executable, "-m", "grpo_flow.flows.cli", *args, "--storage-root", str(tmp_path)],
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert expected in done.stderr


@pytest.mark.parametrize("command", [["serve"], ["train", "--max-steps", "1"]])
def test_an_unreachable_prefect_api_url_is_named_before_anything_starts(tmp_path, command):
    """Prefect's client retried for about 20 s, then named neither the variable nor what to do."""
    environment = {**os.environ, "PREFECT_HOME": str(tmp_path / "home"), "PREFECT_API_URL": "http://127.0.0.1:9/api"}
    done = subprocess.run(
        [sys.executable, "-m", "grpo_flow.flows.cli", *command, "--storage-root", str(tmp_path / "store")],
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr[-2000:]
    assert done.stderr.startswith(
        f"grpo {command[0]}: PREFECT_API_URL=http://127.0.0.1:9/api: no Prefect server answers there"
    ), done.stderr[-2000:]
    assert not (tmp_path / "store" / "runs").exists()


# -- presets ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, dataset, reward", [("math", "math", "math_accuracy"), ("mbpp", "mbpp", "mbpp_tests")])
def test_math_and_mbpp_presets(name, dataset, reward):
    from grpo_flow.workers.rewards.functions import resolve_reward_funcs

    config = preset_config(name)
    assert config.dataset == dataset and config.reward_funcs == [reward]
    assert list(resolve_reward_funcs(config.reward_funcs)) == [reward]
    assert config.prompts_per_step % config.num_rollout_workers == 0

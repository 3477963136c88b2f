"""The Modal app offline: it builds with no network and declares what a run asks for, and every
wrapped method runs with `.local()` on the CPU engines (Modal runs `@modal.enter` and the method
in this process). Modal's internals read here (`_function_info`, `_spec`, image layers) are
modal 1.6.4's; nothing talks to Modal.
"""

import json
from pathlib import Path
import subprocess
import sys

import pyarrow as pa
import pytest
import torch
from modal._image import _Image
from modal._utils.async_utils import synchronizer
from pydantic import ValidationError

import modal
from grpo_flow.schemas.config import GRPOFlowConfig
from grpo_flow.schemas.presets import preset_config
from grpo_flow.workers.backends import modal_app
from grpo_flow.workers.actor.actor import StaleActorError, loss_inputs
from grpo_flow.workers.data.loaders import load_task
from grpo_flow.workers.backends.modal_app import (
    ACTOR_TIMEOUT_S,
    CUDA_BASE_IMAGE,
    ROLLOUT_TIMEOUT_S,
    STARTUP_TIMEOUT_S,
    STORAGE_PACKAGES,
    VOLUME_PATH,
    ActorWorker,
    RolloutWorker,
    VolumeSync,
    build_app,
    build_worker_app,
    worker_config_json,
)
from grpo_flow.workers.backends.modal_backend import (
    GpuMeter,
    ModalNotReadyError,
    ModalPlacement,
    check_modal_ready,
    modal_credentials_found,
)
from grpo_flow.workers.backends.workers import Workers
from grpo_flow.workers.rewards.modal_sandbox import BOOTSTRAP, ModalSandboxExecutor
from grpo_flow.workers.rewards.sandbox import SandboxLimits
from grpo_flow.workers.state.storage import RunStorage
from grpo_flow.workers.rollout.base import GenerationResult, SamplingParams
from grpo_flow.workers.data.tiny_model import ensure_tiny_model
from grpo_flow.workers.backends.servers import StaleEngineError
from grpo_flow.workers.backends.weight_sync import WeightPayload, WeightSyncError

ROOT = Path(__file__).resolve().parents[3]

# `.local()` warns that no Volume is mounted; these tests mean it.
pytestmark = pytest.mark.filterwarnings("ignore:.*executing locally.*:UserWarning")


@pytest.fixture(scope="module")
def model_path(storage_root):
    return str(ensure_tiny_model(storage_root))


def service_function(cls):
    return synchronizer._translate_in(cls._get_class_service_function())


def image_layers(image):
    """(repr, Dockerfile commands) of every layer of an image, top first (modal 1.6.4 internals)."""
    layers, stack = [], [synchronizer._translate_in(image)]
    while stack:
        layer = stack.pop()
        commands = []
        for cell in layer._load.__closure__ or []:
            if getattr(cell.cell_contents, "__name__", "") == "build_dockerfile":
                commands = cell.cell_contents("2025.06").commands
        layers.append((layer._rep, commands))
        stack += [dep for dep in (layer._deps() if layer._deps else []) if isinstance(dep, _Image)]
    return layers


def assert_carries_grpo_flow(image):
    """The image's last layers add grpo_flow's __init__, schemas and workers, from their real folders."""
    mounts, layer = [], synchronizer._translate_in(image)
    while layer is not None:
        deps = layer._deps() if layer._deps else []
        mounts += [repr(dep) for dep in deps if not isinstance(dep, _Image)]
        layer = next((dep for dep in deps if isinstance(dep, _Image)), None)
    text = " ".join(mounts)
    for part in ("schemas", "workers"):
        assert f"local_dir=PosixPath('{ROOT / part}')" in text and f"'/root/grpo_flow/{part}'" in text
    assert "/root/grpo_flow/__init__.py" in text


# -- the app as declared ------------------------------------------------------------------------------
def modal_config(**overrides):
    fields = dict(
        modal_actor_gpu="H100",
        modal_actor_gpu_count=2,
        modal_rollout_gpu="L4",
        modal_volume="grpo-test",
        modal_secrets=["huggingface-secret", "wandb-secret"],
    )
    return preset_config("gsm8k", run_id="modal-test", **{**fields, **overrides})


def test_app_builds_offline_with_both_worker_classes():
    worker_app = build_worker_app(modal_config())
    assert isinstance(worker_app.app, modal.App) and worker_app.app.name == "grpo-flow"
    assert isinstance(worker_app.actor_cls, modal.Cls) and isinstance(worker_app.rollout_cls, modal.Cls)
    assert service_function(worker_app.actor_cls)._tag == "ActorWorker.*"
    assert service_function(worker_app.rollout_cls)._tag == "RolloutWorker.*"
    actor_methods = set(synchronizer._translate_in(worker_app.actor_cls)._get_partial_functions())
    rollout_methods = set(synchronizer._translate_in(worker_app.rollout_cls)._get_partial_functions())
    # The servers' verbs (workers/backends/servers.py), one set for every backend.
    assert {"start", "ready", "step", "save_checkpoint", "restore", "publish"} <= actor_methods
    assert {"start", "ready", "initial", "generate", "load_weights", "shutdown"} <= rollout_methods
    assert isinstance(build_app(modal_config()), modal.App)
    assert isinstance(modal_app.app, modal.App)  # the module's own app, for `modal deploy`


def test_gpus_come_from_the_config():
    worker_app = build_worker_app(modal_config())
    actor, rollout = service_function(worker_app.actor_cls), service_function(worker_app.rollout_cls)
    assert actor._spec.gpus == "H100:2" and actor._function_info.gpus == [("H100", 2)]
    assert rollout._spec.gpus == "L4" and rollout._function_info.gpus == [("L4", 1)]
    single = service_function(build_worker_app(modal_config(modal_actor_gpu="A100", modal_actor_gpu_count=1)).actor_cls)
    assert single._spec.gpus == "A100"


def test_timeouts_are_declared_and_retries_left_to_prefect_and_the_heal_loop():
    config = modal_config()
    worker_app = build_worker_app(config)
    actor, rollout = service_function(worker_app.actor_cls), service_function(worker_app.rollout_cls)
    assert actor._function_info.timeout == ACTOR_TIMEOUT_S and rollout._function_info.timeout == ROLLOUT_TIMEOUT_S
    assert actor._function_info.startup_timeout == rollout._function_info.startup_timeout == STARTUP_TIMEOUT_S
    assert not actor._function_info.max_retries and not rollout._function_info.max_retries
    assert worker_app.options["RolloutWorker"]["max_containers"] == 1
    assert worker_app.options["ActorWorker"]["scaledown_window"] >= 60
    short = service_function(build_worker_app(config, actor_timeout_s=120).actor_cls)
    assert short._function_info.timeout == 120


def test_the_run_volume_is_mounted_and_secrets_come_by_name():
    worker_app = build_worker_app(modal_config())
    for cls in (worker_app.actor_cls, worker_app.rollout_cls):
        function = service_function(cls)
        mount = function._function_info.volumes[VOLUME_PATH]
        assert mount.name == "grpo-test" and not mount.read_only
        assert function._spec.volumes[VOLUME_PATH] is synchronizer._translate_in(worker_app.volume)
        assert [repr(s) for s in function._spec.secrets] == [
            "modal.Secret.from_name('huggingface-secret')",
            "modal.Secret.from_name('wandb-secret')",
        ]


def install_command(image):
    return next(c for _, cmds in image_layers(image) for c in cmds if "uv pip install" in c)


def test_the_gpu_image_is_cuda_with_pinned_packages_hf_cache_on_the_volume_and_our_source():
    worker_app = build_worker_app(modal_config(rollout_engine="transformers"))
    for cls in (worker_app.actor_cls, worker_app.rollout_cls):
        assert service_function(cls)._spec.image is synchronizer._translate_in(worker_app.gpu_image)
    layers = image_layers(worker_app.gpu_image)
    reprs = " ".join(rep for rep, _ in layers)
    commands = [c for _, cmds in layers for c in cmds]
    assert f"from_registry('{CUDA_BASE_IMAGE}')" in reprs
    install = install_command(worker_app.gpu_image)
    for pin in ("torch==2.13.0", "trl==1.16.0", "transformers==5.23.0", "peft==0.21.2"):
        assert pin in install
    assert "vllm" not in install  # vLLM's pins cannot share an environment with the actor's (fastapi, transformers)
    assert f"ENV HF_HOME={VOLUME_PATH}/hf-cache" in commands
    assert_carries_grpo_flow(worker_app.gpu_image)


def test_vllm_engines_get_an_image_of_their_own_pinned_as_grpo_setup_vllm_installs():
    from grpo_flow.workers.backends.vllm_env import CUDA_PACKAGES, VLLM_VERSION

    worker_app = build_worker_app(modal_config(rollout_engine="vllm"))
    assert service_function(worker_app.rollout_cls)._spec.image is synchronizer._translate_in(worker_app.rollout_image)
    assert service_function(worker_app.actor_cls)._spec.image is synchronizer._translate_in(worker_app.gpu_image)
    install = install_command(worker_app.rollout_image)
    assert all(pin in install for pin in CUDA_PACKAGES) and f"vllm=={VLLM_VERSION}" in install
    assert "trl" not in install and "torch==" not in install  # vLLM brings the torch it pins
    commands = [c for _, cmds in image_layers(worker_app.rollout_image) for c in cmds]
    assert "ENV VLLM_ALLOW_INSECURE_SERIALIZATION=1" in commands
    assert_carries_grpo_flow(worker_app.rollout_image)


def test_a_url_roots_app_installs_its_client_in_the_actors_image():
    on_s3 = build_worker_app(modal_config(storage_root="s3://bucket/grpo", rollout_engine="vllm"))
    layers = [c for _, cmds in image_layers(on_s3.gpu_image) for c in cmds if "uv pip install" in c]
    client = next(c for c in layers if "s3fs" in c)
    assert all(package in client for package in STORAGE_PACKAGES) and "torch" not in client  # a layer of its own
    assert any("trl==1.16.0" in c for c in layers)  # the actor's packages, in the layer below it
    on_gcs = build_worker_app(modal_config(storage_root="gs://bucket/grpo"))
    assert "gcsfs" in " ".join(c for _, cmds in image_layers(on_gcs.gpu_image) for c in cmds)
    # The rollout workers never touch the bucket (weights come in the calls); a folder root's image is unchanged.
    for image in (on_s3.rollout_image, build_worker_app(modal_config()).gpu_image):
        assert not [c for _, cmds in image_layers(image) for c in cmds if "s3fs" in c or "universal-pathlib" in c]


@pytest.mark.parametrize(
    ("overrides", "refused"),
    [
        (dict(storage_root="memory://bucket/grpo"), "storage_root: 'memory://bucket/grpo': the Modal containers reach"),
        (dict(storage_root="az://bucket/grpo"), r"through s3fs or gcsfs \(s3://, gs://\), not az://"),
        (dict(weight_sync_method="volume"), "weight_sync_method: 'volume' hands weights over as files .* use 'direct'"),
        (dict(weight_sync_method="checkpoint"), "weight_sync_method: 'checkpoint' hands weights over as files"),
        (dict(use_lora=True), "lora_publish: the rollout workers would take the LoRA adapter as files"),
        (dict(weight_sync_method="reload"), None),
        (dict(weight_sync_method="direct", use_lora=True, lora_publish="merged"), None),
        (dict(storage_root="gs://bucket/grpo"), None),
    ],
)
def test_a_url_root_on_modal_is_refused_only_where_it_cannot_work(tmp_path, overrides, refused):
    config = modal_config(**{"storage_root": "s3://bucket/grpo", **overrides})
    found = dict(MODAL_TOKEN_ID="id", MODAL_TOKEN_SECRET="secret")  # credentials: not what is checked here
    if refused is None:
        check_modal_ready(config, secret_lookup=lambda name: None, env=found)
        return
    with pytest.raises(ModalNotReadyError, match=refused):
        check_modal_ready(config, secret_lookup=lambda name: None, env=found)


def test_on_a_url_root_every_worker_gets_the_url_and_the_weights_travel_in_the_calls():
    config, model_path = modal_config(storage_root="s3://bucket/grpo"), "a-model"  # nothing starts: no model loads
    for mode in ("remote", "local"):
        placement = ModalPlacement(config, model_path, mode=mode, mount=lambda worker: "/a/volume/view")
        assert (
            placement.worker_storage_root("actor") == placement.worker_storage_root("rollout-1") == config.storage_root
        )
        assert not placement.worker_storage_differs()  # no pointer, no Volume copy to prune
        assert placement.weights_method() == "direct"  # `reload`, the default, writes a file no other container sees
    on_volume = ModalPlacement(config.model_copy(update={"storage_root": "/runs"}), model_path, mode="remote")
    assert on_volume.worker_storage_root("actor") == VOLUME_PATH and on_volume.weights_method() == "reload"


def test_a_vllm_container_imports_the_wrapped_classes_without_torch_or_trl():
    """The vLLM image has neither TRL nor the actor's stack: importing the app module must not need them."""
    code = (
        "import sys; import grpo_flow.workers.backends.modal_app; "
        "print(sorted(m for m in ('trl', 'torch', 'prefect', 'peft') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_unknown_gpu_is_refused_by_the_config():
    with pytest.raises(ValidationError, match="modal_actor_gpu: unknown Modal GPU type 'X'"):
        GRPOFlowConfig(modal_actor_gpu="X")
    with pytest.raises(ValidationError, match="modal_rollout_gpu: unknown Modal GPU type 'T1000'"):
        GRPOFlowConfig(modal_rollout_gpu="T1000")


def test_workers_get_a_config_they_can_validate():
    config = modal_config().model_copy(update={"backend": "modal"})  # as the flow will hold it
    parsed = GRPOFlowConfig.model_validate_json(worker_config_json(config))
    # The backend stays `modal`: it used to be rewritten to `local`, and the actor then took the remote
    # engine's log-probs for its own and skipped the IS correction.
    assert parsed.backend == "modal" and parsed.modal_actor_gpu == "H100" and parsed.run_id == "modal-test"
    assert len(worker_config_json(config)) < 16 * 1024  # Modal's limit on class parameters


# -- the wrapped methods, run with .local() --------------------------------------------------------------
def local_config(tmp_path, **overrides):
    return preset_config("tiny", run_id="modal-local", storage_root=str(tmp_path), **overrides)


def rollouts_table(result, n):
    generator = torch.Generator().manual_seed(0)
    return pa.table(
        {
            "prompt_token_ids": [ids for ids in result.prompt_token_ids for _ in range(n)],
            "completion_token_ids": result.completion_token_ids,
            "sampling_logprobs": result.sampling_logprobs,
            "advantage": torch.randn(len(result.texts), generator=generator).tolist(),
        }
    )


def test_wrapped_methods_run_locally_on_cpu(model_path, tmp_path):
    config = local_config(tmp_path, weight_sync_method="volume")
    worker_app = build_worker_app(config)
    config_json = worker_config_json(config)
    actor = worker_app.actor_cls(
        config_json=config_json, model_path=model_path, device="cpu", storage_root=str(tmp_path)
    )
    rollout = worker_app.rollout_cls(
        config_json=config_json, model_path=model_path, worker_index=1, device="cpu", storage_root=str(tmp_path)
    )
    assert actor.ready.local()["policy_version"] == 0
    assert rollout.ready.local()["policy_version"] == 0

    prompts = load_task("last_digit").train.select(range(4))["prompt"]
    params = SamplingParams(n=4, max_tokens=2, seed=3)
    with pytest.raises(StaleEngineError, match=r"holds policy version 0 \(.*\), caller expects 1"):
        rollout.generate.local(1, prompts, params, 32)  # every call that depends on the weights names them
    result = rollout.generate.local(0, prompts, params, 32)
    assert isinstance(result, GenerationResult) and len(result.completion_token_ids) == 16
    assert result.extra["worker_id"] == "rollout-1" and result.extra["policy_version"] == 0
    assert result.extra["prompt_texts"] == prompts

    metrics = actor.step.local(0, rollouts_table(result, 4))
    assert "loss" in metrics
    assert actor.step.local(0, rollouts_table(result, 4)) == metrics  # a retried step is answered, not re-run

    with pytest.raises(StaleActorError):
        actor.publish.local(0, "volume")
    payload, info = actor.publish.local(1, "volume")
    assert isinstance(payload, WeightPayload) and payload.version == 1 and info["bytes"] == payload.nbytes
    assert payload.path.startswith(str(tmp_path / "runs" / "modal-local" / "weights" / "v000001"))
    report = rollout.load_weights.local(payload, 1)
    assert report["version"] == 1 and report["bytes"] == payload.nbytes
    assert rollout.ready.local()["policy_version"] == 1
    assert rollout.load_weights.local(payload, 1)["skipped"]  # a retried sync does nothing

    saved = actor.save_checkpoint.local(1, 1, {"config_hash": "abc"})  # written and committed by the actor
    assert saved["folder"] == "runs/modal-local/checkpoints/step-000001"
    manifest = saved["manifest"]
    assert manifest["policy_version"] == 1 and manifest["config_hash"] == "abc"
    assert {"optimizer.pt", "actor_state.json", "model/model.safetensors"} <= set(manifest["files"])
    assert RunStorage(tmp_path, "modal-local").verify_checkpoint(1) == manifest


def test_rollout_worker_samples_what_the_actor_would_after_a_direct_sync(model_path, tmp_path):
    config = local_config(tmp_path)
    worker_app = build_worker_app(config)
    config_json = worker_config_json(config)
    actor = worker_app.actor_cls(
        config_json=config_json, model_path=model_path, device="cpu", storage_root=str(tmp_path)
    )
    rollout = worker_app.rollout_cls(
        config_json=config_json, model_path=model_path, device="cpu", storage_root=str(tmp_path)
    )
    prompts = load_task("last_digit").train.select(range(6))["prompt"]
    result = rollout.generate.local(0, prompts, SamplingParams(n=4, max_tokens=3, seed=1), 32)
    actor.step.local(0, rollouts_table(result, 4))
    payload, _ = actor.publish.local(1, "direct")
    rollout.load_weights.local(payload, 1)

    after = rollout.generate.local(1, prompts, SamplingParams(n=4, max_tokens=3, seed=5), 32)
    # The actor itself: Modal forwards attribute access to the instance it built for `.local()` calls.
    local_actor = actor.server.actor
    inputs = loss_inputs(rollouts_table(after, 4), local_actor.tokenizer.pad_token_id)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    with torch.no_grad():
        logps, _, _ = local_actor.objective._get_per_token_logps_and_entropies(
            local_actor.model, ids, mask, inputs["completion_ids"].size(1)
        )
    sampled = torch.zeros_like(logps)
    for i, row in enumerate(after.sampling_logprobs):
        sampled[i, : len(row)] = torch.tensor(row)
    completion_mask = inputs["completion_mask"].bool()
    torch.testing.assert_close(logps[completion_mask], sampled[completion_mask], atol=1e-4, rtol=1e-4)


def test_volume_sync_is_a_no_op_outside_a_container():
    sync = VolumeSync("grpo-test")
    sync.commit()
    sync.reload()
    assert sync._volume is None


# -- Workers through ModalPlacement --------------------------------------------------------------------------
class TickingClock:
    """Each reading is one second after the last: every call lasts exactly one second."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        self.now += 1.0
        return self.now


def test_workers_run_through_the_modal_placement(model_path, tmp_path, volume):
    """Each worker in a container of its own, on the Volume double (conftest.py)."""
    config = local_config(tmp_path, weight_sync_method="checkpoint", modal_actor_gpu_count=2)
    placement = ModalPlacement(
        config,
        model_path,
        mode="local",
        rollout_device="cpu",
        actor_device="cpu",
        clock=TickingClock(),
        mount=volume.mount,
    )
    workers = Workers(config, model_path, placement).start()
    assert len(workers.rollout) == config.num_rollout_workers == 2
    # Starting: the placement's ready call per worker, then Workers' own, 1 s each, times each container's GPUs.
    assert placement.step_metrics() == {"gpu_seconds/actor": 4.0, "gpu_seconds/rollout": 4.0}

    prompts = load_task("last_digit").train.select(range(4))["prompt"]
    result = workers.generate(0, 0, prompts, SamplingParams(n=4, max_tokens=2, seed=1), 32)
    assert result.extra["worker_id"] == "rollout-0" and result.extra["policy_version"] == 0
    assert result.extra["prompt_texts"] == prompts

    metrics = workers.actor_step(0, rollouts_table(result, 4))
    assert metrics["gpu_seconds/actor"] == 6.0 and metrics["gpu_seconds/rollout"] == 5.0
    assert workers.actor_version == 1

    # An engine asked for a version it does not hold is brought to it: the actor publishes it, the engine loads it.
    storage = RunStorage(tmp_path, "modal-local")
    assert workers.generate(1, 1, prompts, SamplingParams(n=1, max_tokens=2), 32).extra["policy_version"] == 1
    assert workers.rollout_versions == [0, 1]

    assert workers.sync_weights() == 1
    assert workers.rollout_versions == [1, 1]
    assert workers.last_sync["method"] == "checkpoint" and workers.last_sync["bytes"] > 0

    state = workers.save_checkpoint(storage, 1, {})
    assert state["policy_version"] == 1 and state["rollout_policy_version"] == 1
    assert volume.exists("runs/modal-local/checkpoints/step-000001/optimizer.pt")  # committed on the Volume
    assert storage.verify_checkpoint(1)["policy_version"] == 1  # the run's folder: a pointer to it

    # Back to the start (a resumed run without a checkpoint): the actor and every engine hold version 0.
    assert workers.restore(storage, None) == 0
    assert workers.actor_version == 0 and workers.rollout_versions == [0, 0]
    assert [handle.call("ready", None)["policy_version"] for handle in (workers.actor, *workers.rollout)] == [0, 0, 0]
    workers.close()


def test_gpu_meter_counts_seconds_times_gpus():
    meter = GpuMeter(clock=TickingClock())
    with meter.timed("actor", 4):
        pass
    with pytest.raises(RuntimeError):
        with meter.timed("rollout", 1):
            raise RuntimeError("a failed call still used the GPU")
    assert meter.metrics() == {"gpu_seconds/actor": 4.0, "gpu_seconds/rollout": 1.0}


# -- before anything starts ----------------------------------------------------------------------------
def test_missing_credentials_are_a_clear_error(tmp_path):
    with pytest.raises(ModalNotReadyError, match="no Modal credentials found.*modal token new"):
        check_modal_ready(modal_config(), env={}, config_path=tmp_path / "absent.toml", secret_lookup=lambda name: None)
    only_id = {"MODAL_TOKEN_ID": "ak-1"}
    assert not modal_credentials_found(only_id, tmp_path / "absent.toml")


def test_credentials_from_env_or_modal_toml(tmp_path):
    assert modal_credentials_found({"MODAL_TOKEN_ID": "ak-1", "MODAL_TOKEN_SECRET": "as-1"}, tmp_path / "absent")
    toml_file = tmp_path / ".modal.toml"
    toml_file.write_text('[default]\ntoken_id = "ak-1"\ntoken_secret = "as-1"\nactive = true\n')
    assert modal_credentials_found({}, toml_file)
    toml_file.write_text("[default]\nactive = true\n")
    assert not modal_credentials_found({}, toml_file)
    toml_file.write_text("not toml [")
    assert not modal_credentials_found({}, toml_file)


def test_missing_secret_is_named(tmp_path):
    env = {"MODAL_TOKEN_ID": "ak-1", "MODAL_TOKEN_SECRET": "as-1"}
    looked_up = []

    def lookup(name):
        looked_up.append(name)
        if name == "wandb-secret":
            raise modal.exception.NotFoundError(f"Secret '{name}' not found")

    with pytest.raises(ModalNotReadyError, match="modal_secrets: Modal Secret 'wandb-secret' not found"):
        check_modal_ready(modal_config(), env=env, secret_lookup=lookup)
    assert looked_up == ["huggingface-secret", "wandb-secret"]
    check_modal_ready(modal_config(modal_secrets=["huggingface-secret"]), env=env, secret_lookup=lookup)


def test_lora_sync_without_lora_is_refused_before_anything_starts(tmp_path):
    env = {"MODAL_TOKEN_ID": "ak-1", "MODAL_TOKEN_SECRET": "as-1"}
    with pytest.raises(WeightSyncError, match="use_lora"):
        check_modal_ready(modal_config(weight_sync_method="lora"), env=env, secret_lookup=lambda name: None)


# -- the sandbox executor, against a fake Sandbox.create -------------------------------------------------
class FakeStream:
    def __init__(self, text=""):
        self.text, self.written, self.eof = text, "", False

    def read(self):
        return self.text

    def write(self, data):
        self.written += data

    def write_eof(self):
        self.eof = True

    def drain(self):
        pass


class FakeProcess:
    def __init__(self, returncode, stdout="", stderr=""):
        self.returncode = returncode
        self.stdout, self.stderr, self.stdin = FakeStream(stdout), FakeStream(stderr), FakeStream()

    def wait(self):
        return self.returncode


class FakeSandbox:
    @staticmethod
    def stdin_of(sandbox, index):
        """(payload line, the program's stdin) written to exec number `index`."""
        written = sandbox.processes[index].stdin.written
        payload, _, rest = written.partition("\n")
        return payload, rest

    def __init__(self, results):
        self.results, self.execs, self.processes, self.terminated = list(results), [], [], False

    def exec(self, *args, timeout=None):
        self.execs.append((args, timeout))
        self.processes.append(self.results.pop(0))
        return self.processes[-1]

    def terminate(self):
        self.terminated = True


def test_sandbox_runs_code_without_network_and_maps_the_result():
    created = []
    sandbox = FakeSandbox(
        [
            FakeProcess(0, "4\n", ""),
            FakeProcess(-1, "", ""),
            FakeProcess(1, "", "Traceback"),
            FakeProcess(137, "", ""),
            FakeProcess(0, "x" * 100, ""),
        ]
    )

    def create(**kwargs):
        created.append(kwargs)
        return sandbox

    executor = ModalSandboxExecutor(
        app="APP", image="IMAGE", sandbox_timeout_s=300, create=create, limits=SandboxLimits(output_bytes=10)
    )
    ok = executor.run("print(int(input()) * 2)", stdin="2", timeout_s=2.5)
    assert (ok.stdout, ok.exit_code, ok.signal, ok.timed_out, ok.ok) == ("4\n", 0, None, False, True)
    assert sandbox.execs[0] == (("python", "-I", "-B", "-c", BOOTSTRAP), 3)
    payload, program_stdin = FakeSandbox.stdin_of(sandbox, 0)
    assert json.loads(payload) == {"code": "print(int(input()) * 2)", "files": {}, "script": "main.py"}
    assert program_stdin == "2"
    slow = executor.run("while True: pass", timeout_s=1)
    assert (slow.timed_out, slow.exit_code, slow.signal, slow.ok) == (True, None, "SIGKILL", False)
    failed = executor.run("raise SystemExit(1)")
    assert failed.exit_code == 1 and not failed.timed_out and failed.stderr == "Traceback"
    killed = executor.run("import os; os.kill(os.getpid(), 9)")
    assert (killed.exit_code, killed.signal, killed.timed_out) == (None, "SIGKILL", False)
    chatty = executor.run("print('x' * 100)")
    assert chatty.stdout == "x" * 10 and chatty.stdout_truncated and not chatty.stderr_truncated
    assert created == [dict(app="APP", image="IMAGE", timeout=300, block_network=True, cpu=1.0, memory=1024)]
    executor.close()
    assert sandbox.terminated


def test_sandbox_batch_keeps_order_and_fresh_sandboxes_are_terminated():
    sandboxes = []

    def create(**kwargs):
        sandboxes.append(FakeSandbox([FakeProcess(0, "ok")]))
        return sandboxes[-1]

    executor = ModalSandboxExecutor(app="APP", image="IMAGE", reuse=False, create=create, max_workers=2)
    results = executor.run_batch(["print(1)", "print(2)", "print(3)"], stdins=["a", "b", "c"], timeout_s=5)
    assert [r.stdout for r in results] == ["ok"] * 3 and len(sandboxes) == 3
    assert all(sb.terminated for sb in sandboxes)
    assert sorted(FakeSandbox.stdin_of(sb, 0)[1] for sb in sandboxes) == ["a", "b", "c"]
    with pytest.raises(ValueError, match="2 stdins for 3 programs"):
        executor.run_batch(["1", "2", "3"], stdins=["a", "b"])


def test_the_bootstrap_runs_main_py_with_its_files_and_stdin(tmp_path):
    """What runs inside the sandbox, run here with this interpreter."""
    payload = json.dumps(
        {
            "code": "import helper, sys\nprint(helper.double(int(sys.stdin.read())))\nraise SystemExit(3)",
            "files": {"helper.py": "def double(x):\n    return 2 * x\n", "data/n.txt": "7"},
            "script": "main.py",
        }
    )
    done = subprocess.run(
        [sys.executable, "-I", "-B", "-c", BOOTSTRAP],
        input=payload + "\n21",
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert (done.stdout, done.returncode) == ("42\n", 3), done.stderr


def test_the_plain_classes_stay_undecorated():
    """build_app decorates copies of the registration, never the module's classes, so it can run per config."""
    build_worker_app(modal_config())
    build_worker_app(modal_config(modal_actor_gpu="B200"))
    assert isinstance(ActorWorker, type) and isinstance(RolloutWorker, type)
    assert json.loads(worker_config_json(modal_config()))["modal_actor_gpu"] == "H100"

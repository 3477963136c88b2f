"""The local backend's device (issue 30, item 2): `auto` is a CUDA GPU when torch sees one, the actor and
the transformers engines go on it, TRL's use_cpu and bf16 follow the actor, and vLLM engines are placed
by vllm_mode. Checked here without a GPU; benchmarks/gpu.py checks where each worker ran on one."""

import sys

import pytest
import torch

from grpo_flow.flows.checks import StartCheckError, check_before_start
from grpo_flow.schemas.config import GRPOFlowConfig
from grpo_flow.schemas.presets import preset_config
from grpo_flow.workers import backends
from grpo_flow.workers.actor.trl_objective import device_options
from grpo_flow.workers.backends import vllm_env


def config(**fields):
    return preset_config("tiny", run_id="device", **fields)


@pytest.mark.parametrize(
    "setting, cuda, expected",
    [("auto", True, "cuda"), ("auto", False, "cpu"), ("cpu", True, "cpu"), ("cuda", True, "cuda")],
)
def test_the_device_is_the_config_s_with_auto_a_cuda_gpu_when_there_is_one(monkeypatch, setting, cuda, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    chosen = backends.placement(config(device=setting), "unused-model-path")
    assert chosen.device == expected


def test_cuda_without_a_gpu_is_refused_in_one_line_naming_the_field(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(backends.DeviceError, match=r"^device: 'cuda', but torch sees no CUDA GPU here \("):
        backends.local_device(config(device="cuda"))
    monkeypatch.setattr(vllm_env, "has_cuda", lambda: False)  # before torch loads: what nvidia-smi says
    with pytest.raises(StartCheckError) as caught:
        check_before_start(config(device="cuda", storage_root=str(tmp_path)))
    assert (caught.value.field, caught.value.message) == (
        "device",
        "'cuda', but this machine has no CUDA GPU (nvidia-smi finds none); use cpu or auto",
    )
    with pytest.raises(ValueError, match=r"device\n  Input should be 'auto', 'cuda' or 'cpu'"):
        config(device="gpu")


def test_trls_use_cpu_and_bf16_follow_the_actors_device_not_the_machine(monkeypatch):
    """The actor was on the CPU while TRL was told use_cpu=False, bf16=True on a CUDA machine."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert device_options(config(), "cpu") == {"use_cpu": True, "bf16": False}
    assert device_options(config(), "cuda") == {"use_cpu": False, "bf16": True}
    assert device_options(config(bf16=False), "cuda") == {"use_cpu": False, "bf16": False}
    assert device_options(config(device="cpu")) == {"use_cpu": True, "bf16": False}  # simple mode: no actor
    assert device_options(config()) == {"use_cpu": False, "bf16": True}  # auto, a GPU here


@pytest.mark.parametrize(
    "mode, gpu, expected",
    [("colocate", True, None), ("server", True, "2"), ("colocate", False, ""), ("server", False, "")],
)
def test_vllm_engines_are_placed_by_vllm_mode_and_kept_off_a_gpu_the_run_does_not_use(monkeypatch, mode, gpu, expected):
    monkeypatch.setattr(vllm_env, "has_cuda", lambda: True)
    seen = {}
    monkeypatch.setattr(vllm_env, "engine_process", lambda *args: seen.update(gpu=args[3], env=args[6]))
    run = config(rollout_engine="vllm", vllm_mode=mode)
    vllm_env.local_engine(run, "unused-model-path", 1, threads=1, log_dir=None, gpu=gpu)
    assert seen["gpu"] is gpu and seen["env"].get("CUDA_VISIBLE_DEVICES") == expected


def test_vllm_engines_beside_an_actor_of_several_ranks(monkeypatch, tmp_path):
    """Server mode: engine i on GPU N + i, past the N ranks' GPUs, and a machine with fewer is refused; colocated
    with the ranks on a GPU machine (device auto) is refused as the config refuses device cuda."""
    monkeypatch.setattr(vllm_env, "has_cuda", lambda: True)
    monkeypatch.setattr(vllm_env, "cuda_device_count", lambda: 3)
    seen = {}
    monkeypatch.setattr(vllm_env, "engine_process", lambda *args: seen.update(env=args[6]))
    run = config(rollout_engine="vllm", vllm_mode="server", actor_num_processes=2, vllm_python=sys.executable)
    vllm_env.local_engine(run, "unused-model-path", 1, threads=1, log_dir=None, gpu=True)
    assert seen["env"] == {"CUDA_VISIBLE_DEVICES": "3"}
    vllm_env.check_vllm_ready(run.model_copy(update={"num_rollout_workers": 1}))  # GPUs 0-1 the ranks, 2 the engine
    with pytest.raises(vllm_env.VLLMNotReady, match=r"^vllm_mode server: 2 engines and the actor's 2 rank\(s\) need 4"):
        vllm_env.check_vllm_ready(run)
    colocated = run.model_copy(update={"vllm_mode": "colocate"})
    with pytest.raises(vllm_env.VLLMNotReady, match=r"^actor_num_processes/vllm_mode: vllm_mode 'colocate' on CUDA"):
        vllm_env.check_vllm_ready(colocated)
    vllm_env.check_vllm_ready(colocated.model_copy(update={"device": "cpu"}))  # an engine process beside the ranks


def test_the_device_does_not_change_what_a_run_computes_for_resume():
    assert config(device="cpu").training_hash() == config(device="auto").training_hash()
    assert "device" in GRPOFlowConfig.model_fields

"""The vLLM rollout engine's mapping, without vLLM: fake RequestOutput-shaped objects.

What is pinned here is our side of the contract (the kwargs we give `vllm.SamplingParams`,
how we read `RequestOutput`s, the calls the engine makes on `vllm.LLM`); that vLLM behaves
as documented is not testable on this machine (no GPU, no vLLM).
"""

import sys
import types
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from workers.rollout.base import SamplingParams
from workers.rollout.vllm_engine import (
    VLLMOptions,
    VLLMRolloutEngine,
    _load_safetensors_bytes_in_worker,
    _load_safetensors_file_in_worker,
    from_vllm_outputs,
    to_vllm_sampling_kwargs,
)

EOS = 7


@dataclass
class FakeLogprob:
    logprob: float
    rank: int = 1
    decoded_token: str = ""


@dataclass
class FakeCompletion:
    index: int
    token_ids: list[int]
    logprobs: list[dict[int, FakeLogprob]] | None
    finish_reason: str | None
    text: str = ""


@dataclass
class FakeRequestOutput:
    prompt_token_ids: list[int]
    outputs: list[FakeCompletion]


def completion(index: int, tokens: list[int], finish: str | None, base: float = -0.5) -> FakeCompletion:
    """Each position's dict holds the sampled token and a decoy (as logprobs=N>0 would)."""
    logprobs = [{t: FakeLogprob(base - i), t + 1000: FakeLogprob(-9.0, rank=2)} for i, t in enumerate(tokens)]
    return FakeCompletion(index, tokens, logprobs, finish, text=f"text-{index}")


# -- SamplingParams -----------------------------------------------------------------------------------
def test_sampling_kwargs_carry_our_params_and_ask_for_the_chosen_tokens_logprob():
    params = SamplingParams(n=4, max_tokens=7, temperature=0.7, top_p=0.9, seed=11)
    assert to_vllm_sampling_kwargs(params) == {
        "n": 4,
        "max_tokens": 7,
        "temperature": 0.7,
        "top_p": 0.9,
        "seed": 11,
        "logprobs": 0,
    }


def test_greedy_is_temperature_zero():
    kwargs = to_vllm_sampling_kwargs(SamplingParams(n=1, max_tokens=3, greedy=True, seed=5))
    assert kwargs["temperature"] == 0.0 and "top_p" not in kwargs and kwargs["logprobs"] == 0


def test_every_completion_of_a_batch_gets_its_own_seed():
    """vLLM gives sample j of a request the seed `seed + j`; prompts are spaced n apart."""
    params = SamplingParams(n=8, max_tokens=2, seed=1234)
    seeds = [to_vllm_sampling_kwargs(params, i)["seed"] + j for i in range(5) for j in range(params.n)]
    assert len(set(seeds)) == len(seeds)


# -- RequestOutput -> GenerationResult ---------------------------------------------------------------------
def test_outputs_are_prompt_major_with_the_chosen_tokens_logprobs():
    outputs = [
        # vLLM's outputs list is given out of index order here; the result must follow `index`.
        FakeRequestOutput([1, 2], [completion(1, [5, 6], "length"), completion(0, [3, EOS], "stop")]),
        FakeRequestOutput([7], [completion(0, [8, 9], "length"), completion(1, [EOS], "stop")]),
    ]
    result = from_vllm_outputs(outputs, EOS, n=2, seconds=1.5)
    assert result.prompt_token_ids == [[1, 2], [7]]
    assert result.completion_token_ids == [[3, EOS], [5, 6], [8, 9], [EOS]]
    assert result.finish_reasons == ["stop", "length", "length", "stop"]
    assert result.sampling_logprobs == [[-0.5, -1.5], [-0.5, -1.5], [-0.5, -1.5], [-0.5]]
    assert result.texts == ["text-0", "text-1", "text-0", "text-1"]
    assert result.seconds == 1.5


def test_a_completion_ends_at_its_first_eos_which_it_keeps():
    """As the transformers engine and TRL's completion mask do (vLLM stops there itself, normally)."""
    outputs = [FakeRequestOutput([1], [completion(0, [4, EOS, 5, EOS], "length")])]
    result = from_vllm_outputs(outputs, EOS, n=1)
    assert result.completion_token_ids == [[4, EOS]]
    assert result.sampling_logprobs == [[-0.5, -1.5]]
    assert result.finish_reasons == ["stop"]


def test_several_eos_ids_and_bare_float_logprobs():
    out = FakeCompletion(0, [4, 50, 6], [-0.1, -0.2, -0.3], "length")
    result = from_vllm_outputs([FakeRequestOutput([1], [out])], [50, EOS], n=1)
    assert result.completion_token_ids == [[4, 50]] and result.sampling_logprobs == [[-0.1, -0.2]]


def test_missing_logprobs_wrong_n_and_aborted_requests_are_errors():
    no_logprobs = FakeCompletion(0, [1], None, "length")
    with pytest.raises(ValueError, match="logprobs=0"):
        from_vllm_outputs([FakeRequestOutput([1], [no_logprobs])], EOS, n=1)
    with pytest.raises(ValueError, match="expected n=2"):
        from_vllm_outputs([FakeRequestOutput([1], [completion(0, [1], "length")])], EOS, n=2)
    with pytest.raises(RuntimeError, match="'abort'"):
        from_vllm_outputs([FakeRequestOutput([1], [completion(0, [1], "abort")])], EOS, n=1)
    wrong_token = FakeCompletion(0, [3], [{4: FakeLogprob(-1.0)}], "length")
    with pytest.raises(ValueError, match="sampled token 3"):
        from_vllm_outputs([FakeRequestOutput([1], [wrong_token])], EOS, n=1)


# -- the engine against a fake `vllm` module -----------------------------------------------------------------
class FakeTokenizer:
    eos_token_id = EOS
    eos_token = "<eos>"
    pad_token = "<eos>"

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}


@dataclass
class FakeLLM:
    """Records what the engine asks of `vllm.LLM`; generates `[prompt[0], EOS]` per sample."""

    kwargs: dict[str, Any]
    calls: list[tuple] = field(default_factory=list)

    def generate(self, prompts, sampling_params, use_tqdm, lora_request):
        self.calls.append(("generate", prompts, sampling_params, lora_request))
        return [
            FakeRequestOutput(
                p["prompt_token_ids"], [completion(j, [p["prompt_token_ids"][0], EOS], "stop") for j in range(sp.n)]
            )
            for p, sp in zip(prompts, sampling_params, strict=True)
        ]

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))

    def collective_rpc(self, method, args=()):
        self.calls.append(("collective_rpc", method, args))
        return [0]

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))


@pytest.fixture
def fake_vllm(monkeypatch):
    module = types.ModuleType("vllm")
    module.LLM = lambda **kwargs: FakeLLM(kwargs)

    class SamplingParamsStub:
        def __init__(self, **kwargs):
            self.__dict__.update(kwargs)

    module.SamplingParams = SamplingParamsStub
    lora = types.ModuleType("vllm.lora")
    request = types.ModuleType("vllm.lora.request")
    request.LoRARequest = lambda name, int_id, path: ("lora", name, int_id, path)
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setitem(sys.modules, "vllm.lora", lora)
    monkeypatch.setitem(sys.modules, "vllm.lora.request", request)
    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", lambda path: FakeTokenizer())
    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION", raising=False)
    return module


def test_engine_starts_vllm_with_processed_logprobs_and_our_options(fake_vllm):
    engine = VLLMRolloutEngine("some/model", options=VLLMOptions(gpu_memory_utilization=0.5, max_model_len=64))
    engine.load()
    kwargs = engine.llm.kwargs
    assert kwargs["model"] == "some/model" and kwargs["logprobs_mode"] == "processed_logprobs"
    assert kwargs["gpu_memory_utilization"] == 0.5 and kwargs["max_model_len"] == 64
    assert "enable_lora" not in kwargs
    import os

    assert os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1"


def test_engine_generate_sends_token_ids_and_one_sampling_params_per_prompt(fake_vllm):
    engine = VLLMRolloutEngine("m")
    engine.load()
    result = engine.generate(["ab", "c"], SamplingParams(n=3, max_tokens=4, seed=10), max_prompt_length=1)
    _, prompts, sampling, lora = engine.llm.calls[-1]
    assert prompts == [{"prompt_token_ids": [ord("b")]}, {"prompt_token_ids": [ord("c")]}]  # truncated from the left
    assert [sp.seed for sp in sampling] == [10, 13] and all(sp.logprobs == 0 for sp in sampling)
    assert lora is None
    assert result.completion_token_ids == [[ord("b"), EOS]] * 3 + [[ord("c"), EOS]] * 3
    assert result.finish_reasons == ["stop"] * 6


def test_reload_sleeps_maps_weights_loads_in_place_and_resets_the_prefix_cache(fake_vllm):
    engine = VLLMRolloutEngine("m", options=VLLMOptions(enable_sleep_mode=True))
    engine.load()
    engine.sleep(level=2)
    engine.reload_weights_from("/vol/w.safetensors", version=3)
    engine.wake_up()
    assert engine.llm.calls == [
        ("sleep", 2),
        ("wake_up", ["weights"]),
        ("collective_rpc", _load_safetensors_file_in_worker, ("/vol/w.safetensors",)),
        ("reset_prefix_cache",),
        ("wake_up", None),
    ]
    assert engine.policy_version == 3


def test_sleep_is_a_no_op_without_sleep_mode(fake_vllm):
    engine = VLLMRolloutEngine("m", options=VLLMOptions(enable_sleep_mode=False))
    engine.load()
    engine.sleep(level=2)
    engine.wake_up()
    assert engine.llm.calls == []


def test_state_dict_travels_as_safetensors_bytes(fake_vllm):
    engine = VLLMRolloutEngine("m")
    engine.load()
    engine.load_state_dict({"w": torch.ones(2)}, version=5)
    _, method, (payload,) = engine.llm.calls[0]
    assert method is _load_safetensors_bytes_in_worker and isinstance(payload, bytes)
    from safetensors.torch import load

    assert torch.equal(load(payload)["w"], torch.ones(2)) and engine.policy_version == 5


def test_lora_adapter_becomes_a_new_lora_request_per_version(fake_vllm):
    engine = VLLMRolloutEngine("m", options=VLLMOptions(enable_lora=True, max_lora_rank=8))
    engine.load()
    assert engine.llm.kwargs["enable_lora"] is True and engine.llm.kwargs["max_lora_rank"] == 8
    engine.load_lora_adapter("/vol/lora-v000002", version=2)
    engine.generate(["a"], SamplingParams(n=1, max_tokens=1))
    assert engine.llm.calls[-1][3] == ("lora", "policy-v2", 3, "/vol/lora-v000002")
    plain = VLLMRolloutEngine("m")
    plain.load()
    with pytest.raises(RuntimeError, match="enable_lora"):
        plain.load_lora_adapter("/x", 1)


def test_recreate_replaces_the_engine(fake_vllm):
    engine = VLLMRolloutEngine("m")
    engine.load()
    old = engine.llm
    engine.recreate("/vol/checkpoint-v000004", version=4)
    assert engine.llm is not old and engine.llm.kwargs["model"] == "/vol/checkpoint-v000004"
    assert engine.policy_version == 4 and engine.model_path == "/vol/checkpoint-v000004"


# -- the functions that run inside vLLM's workers ------------------------------------------------------------
class RecordingModel:
    def __init__(self):
        self.loaded: dict[str, torch.Tensor] = {}

    def load_weights(self, weights):
        self.loaded.update(dict(weights))


def fake_worker():
    return types.SimpleNamespace(model_runner=types.SimpleNamespace(model=RecordingModel()))


def test_worker_functions_load_hf_named_tensors(tmp_path):
    from safetensors.torch import save, save_file

    tensors = {"model.embed_tokens.weight": torch.randn(3, 2), "lm_head.weight": torch.randn(3, 2)}
    save_file(tensors, tmp_path / "w.safetensors")
    worker = fake_worker()
    assert _load_safetensors_file_in_worker(worker, str(tmp_path / "w.safetensors")) == 2
    assert all(torch.equal(worker.model_runner.model.loaded[k], v) for k, v in tensors.items())
    worker = fake_worker()
    assert _load_safetensors_bytes_in_worker(worker, save(tensors)) == 2
    assert set(worker.model_runner.model.loaded) == set(tensors)

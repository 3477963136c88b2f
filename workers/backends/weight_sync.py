"""Weight sync: how a rollout engine gets the actor's new policy, five ways.

Each method is two halves, so that on Modal they can run in different containers:
`export_weights(method, actor, run_dir)` on the actor's side returns a small `WeightPayload`
(a path on the storage root, or the serialized bytes themselves), and
`apply_weights(engine, payload)` on the engine's side loads it. `sync_weights(method, actor,
engines, run_dir)` does both in one process and returns a small report
`{"method", "version", "bytes", "seconds", ...}`.

| method       | the actor writes / sends                                   | the engine                                    |
|--------------|------------------------------------------------------------|-----------------------------------------------|
| `reload`     | `weights/reload/model.safetensors` (a scratch file)        | sleep(level 2) → load in place → wake_up      |
| `volume`     | `weights/v000042/` model.safetensors + config.json         | loads the versioned file in place             |
| `direct`     | safetensors bytes in memory (what a Modal call carries)    | loads them in place                           |
| `checkpoint` | `weights/checkpoint-v000042/`, a full `save_pretrained`    | is re-created from that folder                |
| `lora`       | `weights/lora-v000042/`, the peft adapter only             | applies the adapter (vLLM: a new LoRARequest) |

The actor's half uses only what the one-process `Actor` and the N-rank `ActorGroup`
(workers/actor/sharded.py) both answer: `policy_state_dict()` and `adapter_state_dict()` (a group's ranks
gather the full tensors on rank 0, which sends them back; no rank's optimizer state moves), `policy_version`,
`uses_lora`, `config` and `model_path` (the config, generation config and tokenizer a folder holds are those
of the model the actor loaded). So every method works from N ranks as from one.

Folders are written under a hidden temporary name and renamed into place, and a version
folder that already exists is reused: a retried or preempted export never leaves a partial
folder and never writes a version twice (the actor's policy version names its weights).
Paths are under the run folder (`<storage_root>/runs/<run_id>/`), which on Modal is the Volume:
the writer commits it, the reader reloads it (see workers/backends/modal_app.py).

The engines: `grpo_flow.workers.rollout.transformers_engine.TransformersRolloutEngine` (CPU; it has no sleep mode, so
sleep/wake are no-ops) and
`grpo_flow.workers.rollout.vllm_engine.VLLMRolloutEngine` (or `VLLMProcessEngine`, the same in a process of the
vLLM environment). tests/workers/backends/test_weight_sync.py runs every method on CPU between the
real actor and the transformers engine; tests/workers/rollout/test_vllm_real.py runs each against
vLLM's CPU build (sleep mode, which `reload` uses on a GPU, does not exist there).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from grpo_flow.schemas.config import WeightSyncMethod
from grpo_flow.workers.state.storage import atomic_folder, atomic_write

METHODS: tuple[str, ...] = ("reload", "volume", "direct", "checkpoint", "lora")
WEIGHTS_FILE = "model.safetensors"
LORA_ADAPTER_FILE = "adapter_model.safetensors"
GENERATION_CONFIG_FILE = "generation_config.json"


class WeightSyncError(ValueError):
    """The chosen weight_sync_method cannot work with this actor or config."""


@dataclass(frozen=True)
class WeightPayload:
    """What travels from the actor to an engine: a path on the storage root, or bytes (`direct`)."""

    method: str
    version: int
    path: str | None = None
    data: bytes | None = None
    nbytes: int = 0
    export_s: float = 0.0

    def file(self) -> str:
        """The path this payload names (every method but `direct` has one)."""
        if self.path is None:
            raise WeightSyncError(f"a {self.method!r} weight payload (version {self.version}) carries no path")
        return self.path

    def bytes(self) -> bytes:
        """The serialized weights of a `direct` payload."""
        if self.data is None:
            raise WeightSyncError(f"a {self.method!r} weight payload (version {self.version}) carries no bytes")
        return self.data


# -- layout ------------------------------------------------------------------------------------------
def weights_root(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "weights"


def version_dir(run_dir: str | os.PathLike, version: int, kind: str = "") -> Path:
    """`weights/v000042` (volume), `weights/checkpoint-v000042`, `weights/lora-v000042`."""
    prefix = f"{kind}-" if kind else ""
    return weights_root(run_dir) / f"{prefix}v{version:06d}"


def folder_bytes(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# -- checks ------------------------------------------------------------------------------------------
def is_peft_model(model: Any) -> bool:
    """True for a peft `PeftModel` (checked by attribute, so peft need not be installed)."""
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def require_lora_actor(actor: Any) -> None:
    if not actor.uses_lora:
        raise WeightSyncError(
            "weight_sync_method='lora' sends only a LoRA adapter, but the actor trains the full model "
            "(use_lora is off, so it has no peft adapter): set use_lora=True, or choose weight_sync_method "
            "'reload', 'volume', 'direct' or 'checkpoint'"
        )


def check_weight_sync_config(config: Any) -> None:
    """Refuse, before anything loads, a `lora` sync for a run that trains no adapter."""
    if config.weight_sync_method == "lora" and not getattr(config, "use_lora", False):
        raise WeightSyncError(
            "weight_sync_method='lora' needs use_lora=True (the actor must train a peft adapter); "
            "choose 'reload', 'volume', 'direct' or 'checkpoint' for full-model training"
        )


def _save_state_dict(actor: Any, path: Path) -> None:
    from safetensors.torch import save_file

    # policy_state_dict clones every tensor, so tied weights (embeddings / lm_head) are separate
    # tensors here and safetensors accepts them; loaders take both names.
    save_file({name: t.contiguous() for name, t in actor.policy_state_dict().items()}, str(path))


def _save_model_config(actor: Any, folder: Path) -> None:
    """config.json of the model the actor loaded, saying float32 (the dtype the actor trains and exports in).
    Read from `actor.model_path`, not `actor.model`: an ActorGroup's model lives in its rank processes."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(actor.model_path)
    config.dtype = "float32"
    config.save_pretrained(folder)


def _save_model_folder(actor: Any, folder: Path) -> None:
    """A transformers model folder of the policy: the weights (merged with use_lora), the config, and the
    generation config and tokenizer of the model the actor loaded."""
    from transformers import AutoTokenizer

    _save_state_dict(actor, folder / WEIGHTS_FILE)
    _save_model_config(actor, folder)
    generation = Path(actor.model_path) / GENERATION_CONFIG_FILE
    if generation.is_file():
        shutil.copyfile(generation, folder / GENERATION_CONFIG_FILE)
    AutoTokenizer.from_pretrained(actor.model_path).save_pretrained(folder)


def _save_adapter(actor: Any, folder: Path) -> None:
    """A peft adapter folder (adapter_config.json + adapter_model.safetensors) of the actor's LoRA adapter,
    configured as the actor's (trl_objective.lora_config), the base model the actor loaded."""
    from safetensors.torch import save_file

    from grpo_flow.workers.actor.trl_objective import lora_config

    config = lora_config(actor.config)
    config.base_model_name_or_path, config.inference_mode = actor.model_path, True
    config.save_pretrained(str(folder))
    save_file({name: t.contiguous() for name, t in actor.adapter_state_dict().items()}, str(folder / LORA_ADAPTER_FILE))


# -- actor side --------------------------------------------------------------------------------------
def _export_reload(actor: Any, run_dir: Path) -> WeightPayload:
    path = weights_root(run_dir) / "reload" / WEIGHTS_FILE
    atomic_write(path, lambda tmp: _save_state_dict(actor, tmp))
    return WeightPayload("reload", actor.policy_version, path=str(path), nbytes=path.stat().st_size)


def _export_volume(actor: Any, run_dir: Path) -> WeightPayload:
    version = actor.policy_version
    final = version_dir(run_dir, version)

    def write(folder: Path) -> None:
        _save_state_dict(actor, folder / WEIGHTS_FILE)
        _save_model_config(actor, folder)
        (folder / "version.json").write_text(json.dumps({"policy_version": version}))

    atomic_folder(final, write)
    path = final / WEIGHTS_FILE
    return WeightPayload("volume", version, path=str(path), nbytes=path.stat().st_size)


def _export_direct(actor: Any, run_dir: Path) -> WeightPayload:
    from safetensors.torch import save

    data = save({name: t.contiguous() for name, t in actor.policy_state_dict().items()})
    return WeightPayload("direct", actor.policy_version, data=data, nbytes=len(data))


def _export_checkpoint(actor: Any, run_dir: Path) -> WeightPayload:
    final = version_dir(run_dir, actor.policy_version, "checkpoint")
    atomic_folder(final, lambda folder: _save_model_folder(actor, folder))
    return WeightPayload("checkpoint", actor.policy_version, path=str(final), nbytes=folder_bytes(final))


def _export_lora(actor: Any, run_dir: Path) -> WeightPayload:
    require_lora_actor(actor)
    final = version_dir(run_dir, actor.policy_version, "lora")
    atomic_folder(final, lambda folder: _save_adapter(actor, folder))
    return WeightPayload("lora", actor.policy_version, path=str(final), nbytes=folder_bytes(final))


_EXPORTS: dict[str, Callable[[Any, Path], WeightPayload]] = {
    "reload": _export_reload,
    "volume": _export_volume,
    "direct": _export_direct,
    "checkpoint": _export_checkpoint,
    "lora": _export_lora,
}


def export_weights(method: WeightSyncMethod | str, actor: Any, run_dir: str | os.PathLike) -> WeightPayload:
    """The actor's half: write or serialize its current weights for `method`."""
    if method not in _EXPORTS:
        raise WeightSyncError(f"weight_sync_method: unknown method {method!r}; known: {', '.join(METHODS)}")
    started = time.perf_counter()
    payload = _EXPORTS[method](actor, Path(run_dir))
    return WeightPayload(
        payload.method, payload.version, payload.path, payload.data, payload.nbytes, time.perf_counter() - started
    )


# -- engine side -------------------------------------------------------------------------------------
def _is_vllm_engine(engine: Any) -> bool:
    return hasattr(engine, "reload_weights_from")


def _load_file(engine: Any, path: str, version: int) -> None:
    if _is_vllm_engine(engine):
        engine.reload_weights_from(path, version)
    else:
        from safetensors.torch import load_file

        engine.load_state_dict(load_file(path), version)


def _apply_reload(engine: Any, payload: WeightPayload) -> None:
    # vLLM's documented RLHF sequence: a level-2 sleep discards weights and KV cache, the weights'
    # memory is mapped and written, then the KV cache comes back. The transformers engine has no
    # sleep mode, so for it this is a plain load.
    if hasattr(engine, "sleep"):
        engine.sleep(level=2)
    _load_file(engine, payload.file(), payload.version)
    if hasattr(engine, "wake_up"):
        engine.wake_up()


def _apply_volume(engine: Any, payload: WeightPayload) -> None:
    _load_file(engine, payload.file(), payload.version)


def _apply_direct(engine: Any, payload: WeightPayload) -> None:
    if _is_vllm_engine(engine):
        engine.load_state_dict(payload.bytes(), payload.version)  # vLLM's workers deserialize the bytes
    else:
        from safetensors.torch import load

        engine.load_state_dict(load(payload.bytes()), payload.version)


def _apply_checkpoint(engine: Any, payload: WeightPayload) -> None:
    engine.recreate(payload.file(), payload.version)


def _apply_lora(engine: Any, payload: WeightPayload) -> None:
    if hasattr(engine, "load_lora_adapter"):
        engine.load_lora_adapter(payload.file(), payload.version)
        return
    # The transformers engine: the first adapter wraps its base model in peft (the same forward
    # as the actor's PeftModel); later ones only replace the adapter's tensors.
    from peft import PeftModel, set_peft_model_state_dict
    from safetensors.torch import load_file

    if is_peft_model(engine.model):
        set_peft_model_state_dict(engine.model, load_file(str(Path(payload.file()) / LORA_ADAPTER_FILE)))
    else:
        engine.model = PeftModel.from_pretrained(engine.model, payload.file())
    engine.model.eval()
    engine.policy_version = payload.version


_APPLIES: dict[str, Callable[[Any, WeightPayload], None]] = {
    "reload": _apply_reload,
    "volume": _apply_volume,
    "direct": _apply_direct,
    "checkpoint": _apply_checkpoint,
    "lora": _apply_lora,
}


def apply_weights(engine: Any, payload: WeightPayload) -> dict[str, Any]:
    """The engine's half: load what the actor exported; returns the engine's report."""
    started = time.perf_counter()
    _APPLIES[payload.method](engine, payload)
    return {
        "method": payload.method,
        "version": payload.version,
        "bytes": payload.nbytes,
        "seconds": time.perf_counter() - started,
        "worker_id": getattr(engine, "worker_id", None),
    }


# -- both halves in one process ------------------------------------------------------------------------
def sync_weights(
    method: WeightSyncMethod | str, actor: Any, engines: Sequence[Any], run_dir: str | os.PathLike
) -> dict[str, Any]:
    """Export once, apply to every engine. `bytes` counts what reached the engines in all."""
    started = time.perf_counter()
    payload = export_weights(method, actor, run_dir)
    reports = [apply_weights(engine, payload) for engine in engines]
    return {
        "method": payload.method,
        "version": payload.version,
        "bytes": payload.nbytes * len(engines),
        "seconds": time.perf_counter() - started,
        "export_s": payload.export_s,
        "apply_s": sum(r["seconds"] for r in reports),
    }

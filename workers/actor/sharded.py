"""The actor as N ranks of one torch.distributed process group (`actor_num_processes` > 1).

    group = ActorGroup(config, model_path, device)   # the Actor surface the servers use
    group.load()                                     # starts the N rank processes; each loads and shards
    group.step(expected_version, rollouts)           # rank 0's answer, what Actor.step returns
    group.close()

Every call goes to every rank, which run the same collectives, and rank 0 answers. Each rank holds a
`ShardedActor`: the policy (with use_lora the PeftModel) sharded with FSDP2's `fully_shard` on each decoder
layer, then the root; gloo on CPU, NCCL on GPUs (rank r on cuda:r).

A step's completions go to the ranks in contiguous shares, equal for a full step (the config refuses one that
does not split evenly). The loss is normalised over all ranks' completions: the sequence count and the loss's token
count (dapo's `num_items_in_batch`) are all-reduced, each rank's loss is its exact share of the whole
batch's, and FSDP's reduce-scatter sums the gradients (its 1/N divide turned off). TRL under N accelerate
processes divides a rank's dapo loss by the global token count / N and averages the gradients: the same
gradient. Each rank runs as many micro-batches as the rank with the most, so every forward and backward
meets its collectives.

The ranks are started with torch.multiprocessing (spawn) rather than torchrun: they are children of the
process that serves the actor's verbs, which keeps a pipe to each; torchrun would start them apart from it,
with no channel for the calls.

Weights for the engines are gathered as full tensors on rank 0 when asked. A checkpoint holds the optimizer
state as torch.distributed.checkpoint writes it (a file per rank, `optimizer/`) and otherwise what the
one-process actor writes (the weights gathered on rank 0: `model/` stays a transformers folder). It resumes
under any actor_num_processes (the one-process actor reads the shards too): a restore loads it whole on every
rank, then shards it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, cast

import pyarrow as pa
import torch
import torch.distributed as dist

from grpo_flow.schemas.config import GRPOFlowConfig
from grpo_flow.workers.actor.actor import OPTIMIZER_SHARDS_DIR, Actor, StaleActorError, even_micro_batches

# A rank's answer summed over the ranks (each rank's loss is its share of the whole batch's; each rank's
# throughput is its own); every other metric is the mean of the ranks'.
SUMMED_METRICS = ("loss", "actor/tokens_per_second")


def merge_rank_metrics(results: list[dict[str, float]]) -> dict[str, float]:
    """One step's metrics from every rank's: the loss and throughput summed, the rest averaged."""
    return {
        name: sum(r[name] for r in results) / (1 if name in SUMMED_METRICS else len(results)) for name in results[0]
    }


def full_options(cpu_offload: bool = True) -> Any:
    """torch.distributed.checkpoint's options for whole tensors (on rank 0 only, with cpu_offload)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload)


class ShardedActor(Actor):
    """One rank's actor: `Actor` with the model sharded across the process group."""

    def __init__(
        self, config: GRPOFlowConfig, model_path: str | Path, device: str, rank: int, world_size: int, init_method: str
    ):
        super().__init__(config, model_path, device)
        self.rank, self.world_size, self.init_method = rank, world_size, init_method
        self.sharded: list[Any] = []  # the FSDP modules: each decoder layer, then the root

    def load(self) -> None:
        super().load()
        if not dist.is_initialized():  # after TRL's trainer is built, so accelerate's state sees one process
            backend = "nccl" if self.device.startswith("cuda") else "gloo"
            dist.init_process_group(backend, init_method=self.init_method, rank=self.rank, world_size=self.world_size)
        self._shard()

    def _shard(self) -> None:
        """fully_shard each decoder layer, then the root; the optimizer built again over the shards."""
        from torch.distributed.fsdp import fully_shard

        base = self.model.get_base_model() if self.uses_lora else self.model
        layers = [m for m in self.model.modules() if type(m).__name__ in (base._no_split_modules or ())]
        self.sharded = [*layers, self.model]
        for module in self.sharded:
            fully_shard(module)
            module.set_gradient_divide_factor(1.0)  # summed: each rank's loss is already its share
            module.set_force_sum_reduction_for_comms(True)  # gloo has no pre-multiplied sum
        self.create_optimizer()

    def restore(self, folder: Path) -> None:
        """A checkpoint loaded whole (the one-process actor's restore), then sharded with its optimizer state."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

        Actor.load(self)
        super().restore(folder)
        optimizer = get_optimizer_state_dict(self.model, self.objective.optimizer, options=full_options(False))
        scheduler = self.objective.lr_scheduler.state_dict()
        self._shard()
        set_optimizer_state_dict(self.model, self.objective.optimizer, optimizer, options=full_options(False))
        self.objective.lr_scheduler.load_state_dict(scheduler)

    def _all_reduce(self, values: list[float], op: Any = dist.ReduceOp.SUM) -> list[float]:
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor, op=op)
        return tensor.tolist()

    def step(self, expected_version: int, rollouts: pa.Table) -> dict[str, float]:
        """This rank's contiguous share of the step's rows through Actor.step; every rank's metrics merged. The
        shares are equal when the rows split evenly (the config's rule for a full step), else a row apart (a step
        dynamic sampling could not fill): the loss is the whole batch's either way."""
        first, last = (rollouts.num_rows * r // self.world_size for r in (self.rank, self.rank + 1))
        result = super().step(expected_version, rollouts.slice(first, last - first))
        results: list[Any] = [None] * self.world_size
        dist.all_gather_object(results, result)
        return merge_rank_metrics(results)

    def _corrects_sampling(self, rollouts: pa.Table) -> bool:
        # Decided for the whole batch: a rank that computed old log-probs alone would wait on the others.
        return self._all_reduce([float(super()._corrects_sampling(rollouts))], dist.ReduceOp.MAX)[0] > 0

    def _parts(self, inputs: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        parts = super()._parts(inputs)
        count = int(self._all_reduce([len(parts)], dist.ReduceOp.MAX)[0])
        return parts if len(parts) == count else even_micro_batches(inputs, count)

    def _batch_totals(self, inputs: dict[str, torch.Tensor]) -> tuple[int, torch.Tensor]:
        rows, tokens = super()._batch_totals(inputs)
        total_rows, total_tokens = self._all_reduce([rows, float(tokens)])
        return int(total_rows), torch.tensor(total_tokens, dtype=torch.float32, device=self.device)

    def _clip_gradients(self) -> float:
        from torch.distributed.tensor import DTensor

        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)
        assert isinstance(norm, DTensor)  # the norm over every rank's shards
        return float(norm.full_tensor())

    def _module_state(self, module: Any) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        state = get_model_state_dict(module, options=full_options())  # on rank 0; {} on the others
        return cast(dict[str, torch.Tensor], state)

    @contextlib.contextmanager
    def _full_parameters(self) -> Iterator[bool]:
        for module in self.sharded:
            module.unshard()
        try:
            yield self.rank == 0
        finally:
            for module in self.sharded:
                module.reshard()

    def adapter_state_dict(self) -> dict[str, torch.Tensor]:
        from peft import get_peft_model_state_dict

        state = self._module_state(self.model)
        return get_peft_model_state_dict(self.model, state_dict=state) if self.rank == 0 else {}

    def _checkpoint_states(self) -> tuple[dict[str, torch.Tensor] | None, dict[str, Any] | None]:
        return self._module_state(self.model), None  # the optimizer's shards are written apart

    def save_checkpoint(self, folder: Path) -> dict[str, Any]:
        """Each rank writes its optimizer shard (torch.distributed.checkpoint); rank 0 the rest of what
        Actor.save_checkpoint writes, the weights gathered."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        state = {"optimizer": get_optimizer_state_dict(self.model, self.objective.optimizer)}
        dcp.save(state, checkpoint_id=folder / OPTIMIZER_SHARDS_DIR)
        if self.rank == 0:
            return super().save_checkpoint(folder)
        self._checkpoint_states()  # the gathers rank 0 waits on
        return {}


def serve_rank(
    rank: int, world_size: int, init_method: str, config_json: str, model_path: str, device: str, pipe: Connection
) -> None:
    """A rank's process: load and shard, then run each call the pipe brings until `close`."""
    config = GRPOFlowConfig.model_validate_json(config_json)
    if device.startswith("cuda"):
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    actor = ShardedActor(config, model_path, device, rank, world_size, init_method)

    def answer(verb: str, args: tuple[Any, ...]) -> None:
        try:
            pipe.send((True, getattr(actor, verb)(*args), actor.policy_version))
        except Exception as error:  # the caller raises it (a StaleActorError heals the actor)
            pipe.send((False, error, actor.policy_version))

    answer("load", ())
    while True:
        try:
            verb, args = pipe.recv()
        except (EOFError, ConnectionResetError):  # the group's process is gone (a Ray actor killed): end with it
            break
        if verb == "close":
            break
        answer(verb, args)
    dist.destroy_process_group()


class RankExited(StaleActorError):
    """An actor rank's process ended under a call: the group was started again (the initial model), so
    `Workers` heals it as a restarted actor (the newest checkpoint, the logged steps since)."""


class ActorGroup:
    """The actor as `config.actor_num_processes` rank processes (ShardedActor each); rank 0 answers.

    A call waits on every rank's pipe and process at once: a rank that dies (killed, out of memory) is seen
    when it ends, while the others may wait in a collective for it that never comes. Then every rank is ended
    and a new group started, and the call raises `RankExited` naming the rank and its exit code."""

    def __init__(self, config: GRPOFlowConfig, model_path: str | Path, device: str = "cpu"):
        self.config, self.model_path, self.device = config, str(model_path), device
        self.policy_version = 0
        self.processes: list[Any] = []
        self.pipes: list[Connection] = []
        self.rendezvous: str | None = None

    @property
    def loaded(self) -> bool:
        return bool(self.processes)

    @property
    def uses_lora(self) -> bool:
        return self.config.use_lora

    def load(self) -> None:
        """Start the ranks; back when every rank has loaded its shard."""
        context = torch.multiprocessing.get_context("spawn")
        self.rendezvous = tempfile.mkdtemp(prefix="grpo-flow-actor-")
        init_method = f"file://{self.rendezvous}/store"
        world_size = self.config.actor_num_processes
        for rank in range(world_size):
            ours, theirs = context.Pipe()
            args = (rank, world_size, init_method, self.config.model_dump_json(), self.model_path, self.device, theirs)
            process = context.Process(target=serve_rank, args=args, name=f"actor-rank-{rank}", daemon=True)
            process.start()
            theirs.close()
            self.processes.append(process)
            self.pipes.append(ours)
        self._answer("load")

    def _answer(self, verb: str) -> Any:
        """Every rank's reply to `verb`, rank 0's returned; a rank's error raised."""
        replies: dict[int, Any] = {}
        while len(replies) < len(self.pipes):
            pipes = {self.pipes[r]: r for r in range(len(self.pipes)) if r not in replies}
            sentinels = {self.processes[r].sentinel: r for r in pipes.values()}
            for ready in wait([*pipes, *sentinels]):
                if isinstance(ready, Connection):
                    try:
                        replies[pipes[ready]] = ready.recv()
                    except (EOFError, ConnectionResetError):  # reset: it died with our call unread
                        self._lost(pipes[ready], verb)
                elif sentinels[ready] not in replies and not self.pipes[sentinels[ready]].poll():  # no reply left
                    self._lost(sentinels[ready], verb)
        failed = next((replies[rank] for rank in sorted(replies) if not replies[rank][0]), None)
        if failed is not None:
            raise failed[1]
        self.policy_version = replies[0][2]
        return replies[0][1]

    def _lost(self, rank: int, verb: str) -> None:
        """Rank `rank` ended under `verb`: every rank is ended (the others may wait on it in a collective) and,
        unless it was loading, a new group started; RankExited says which rank and its exit code."""
        self.processes[rank].join()
        message = f"actor rank {rank} exited (code {self.processes[rank].exitcode}) under {verb!r}"
        self.close(wait=False)
        if verb == "load":
            raise RuntimeError(message)
        self.load()
        raise RankExited(f"{message}; its {len(self.processes)} ranks were started again on the initial model")

    def call(self, verb: str, *args: Any) -> Any:
        for pipe in self.pipes:
            try:
                pipe.send((verb, args))
            except OSError:  # its process is gone: _answer sees it end
                break
        return self._answer(verb)

    def step(self, expected_version: int, rollouts: pa.Table) -> dict[str, float]:
        return self.call("step", expected_version, rollouts)

    def save_checkpoint(self, folder: Path) -> dict[str, Any]:
        return self.call("save_checkpoint", folder)

    def restore(self, folder: Path) -> None:
        self.call("restore", folder)

    def reset(self) -> None:
        self.call("reset")

    def policy_state_dict(self) -> dict[str, torch.Tensor]:
        return self.call("policy_state_dict")

    def adapter_state_dict(self) -> dict[str, torch.Tensor]:
        return self.call("adapter_state_dict")

    def published_weights(self) -> dict[str, torch.Tensor]:
        return self.call("published_weights")

    def close(self, wait: bool = True) -> None:
        """End the ranks: each leaves the process group first, unless `wait` is False (one died: the others are
        killed, as they may be waiting on it)."""
        for pipe in self.pipes if wait else ():
            with contextlib.suppress(OSError):
                pipe.send(("close", ()))
        for process in self.processes:
            process.join(timeout=30 if wait else 0)
            if process.is_alive():
                process.kill()
                process.join()
        for pipe in self.pipes:
            pipe.close()
        self.processes, self.pipes = [], []
        if self.rendezvous:
            shutil.rmtree(self.rendezvous, ignore_errors=True)

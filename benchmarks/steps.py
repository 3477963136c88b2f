"""What the benchmarks that run the real `grpo` flow share: per-step wall times taken around each
`grpo-step` subflow call without editing the flow, Prefect API counts, the step's tasks without Prefect,
and randomly initialised models to run them on."""

from __future__ import annotations

import collections
import contextlib
import os
import re
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


class StepClock:
    """Start and end times of every step the `grpo` flow runs while `watch()` is active: its
    `grpo-step` subflow call, or its `run_step` call when `step_subflows` is off.

    `intervals()` are start-to-start times: a step plus what the parent flow does between two
    steps (the progress artifact, the progress bar), i.e. what each step costs a run.
    """

    def __init__(
        self,
        counter: ApiCounter | None = None,
        count_from: int = 2,
        after_step: Callable[[Any, Any, int], None] | None = None,
    ) -> None:
        self.starts: dict[int, float] = {}
        self.ends: dict[int, float] = {}
        self.counter, self.count_from = counter, count_from  # API calls from step `count_from` on
        self.counted: dict[str, Any] | None = None
        self.plan: Any = None  # the RunPlan the flow passed to its first step
        # Called as after_step(config, plan, step) once a step has finished, before the flow goes on
        # (benchmarks/learning.py copies the actor's weights there).
        self.after_step = after_step

    @contextlib.contextmanager
    def watch(self) -> Iterator[StepClock]:
        import grpo_flow.flows.grpo as module

        originals = {name: getattr(module, name) for name in ("grpo_step", "run_step")}

        def timed(original: Any) -> Any:
            def timed_step(config: Any, plan: Any, step: int, *args: Any, **kwargs: Any) -> Any:
                # The subflow calls run_step inside it: the outer call's start and end count.
                outer = step not in self.starts or step in self.ends
                if outer:
                    self.plan = self.plan or plan
                    if self.counter is not None and step == self.count_from:
                        self.counter.reset()
                    self.starts[step] = time.perf_counter()
                    self.ends.pop(step, None)
                try:
                    result = original(config, plan, step, *args, **kwargs)
                finally:
                    if outer:
                        self.ends[step] = time.perf_counter()
                        if self.counter is not None and step == plan.total_steps and step >= self.count_from:
                            self.counted = self.counter.per_step(step - self.count_from + 1)
                if outer and self.after_step is not None:
                    self.after_step(config, plan, step)
                return result

            return timed_step

        for name, original in originals.items():  # `grpo` looks both up in its module at each step
            setattr(module, name, timed(original))
        try:
            yield self
        finally:
            for name, original in originals.items():
                setattr(module, name, original)

    def reset(self) -> None:
        self.starts.clear()
        self.ends.clear()

    def intervals(self) -> dict[int, float]:
        """Step -> seconds from its start to the next step's start (the last step: to its end)."""
        steps = sorted(self.starts)
        out = {}
        for this, after in zip(steps, steps[1:] + [None], strict=True):
            out[this] = (self.starts[after] if after is not None else self.ends[this]) - self.starts[this]
        return out

    def subflow_seconds(self) -> dict[int, float]:
        return {step: self.ends[step] - self.starts[step] for step in self.starts if step in self.ends}


_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


class ApiCounter:
    """Requests this process makes to the Prefect API (by method and path, ids folded) and events it
    sends: a count that does not depend on how busy the machine is."""

    def __init__(self) -> None:
        self.requests: collections.Counter[str] = collections.Counter()
        self.request_seconds: collections.Counter[str] = collections.Counter()
        self.events: collections.Counter[str] = collections.Counter()

    def _key(self, request: Any) -> str:
        path = _ID.sub("{id}", request.url.path)
        return f"{request.method} {path.split('/api', 1)[-1]}"

    @contextlib.contextmanager
    def watch(self) -> Iterator[ApiCounter]:
        from prefect.client.base import PrefectHttpxAsyncClient, PrefectHttpxSyncClient
        from prefect.events.clients import PrefectEventsClient

        sync_send, async_send, emit = (
            PrefectHttpxSyncClient.send,
            PrefectHttpxAsyncClient.send,
            PrefectEventsClient._emit,
        )
        counter = self

        def counted_sync_send(client: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return sync_send(client, request, *args, **kwargs)
            finally:
                counter.requests[counter._key(request)] += 1
                counter.request_seconds[counter._key(request)] += time.perf_counter() - started

        async def counted_async_send(client: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return await async_send(client, request, *args, **kwargs)
            finally:
                counter.requests[counter._key(request)] += 1
                counter.request_seconds[counter._key(request)] += time.perf_counter() - started

        async def counted_emit(client: Any, event: Any) -> None:
            counter.events[event.event] += 1
            return await emit(client, event)

        PrefectHttpxSyncClient.send, PrefectHttpxAsyncClient.send = counted_sync_send, counted_async_send
        PrefectEventsClient._emit = counted_emit
        try:
            yield self
        finally:
            PrefectHttpxSyncClient.send, PrefectHttpxAsyncClient.send = sync_send, async_send
            PrefectEventsClient._emit = emit

    def reset(self) -> None:
        self.requests.clear()
        self.request_seconds.clear()
        self.events.clear()

    def per_step(self, steps: int) -> dict[str, Any]:
        return {
            "requests": sum(self.requests.values()) / steps,
            "request_ms": 1000 * sum(self.request_seconds.values()) / steps,
            "events": sum(self.events.values()) / steps,
            "requests_by_endpoint": {k: v / steps for k, v in self.requests.most_common()},
            "request_ms_by_endpoint": {
                k: 1000 * self.request_seconds[k] / steps for k, _ in self.requests.most_common()
            },
            "events_by_kind": {k: v / steps for k, v in self.events.most_common()},
        }


def median_of(values: dict[int, float], steps: range | list[int]) -> float:
    chosen = [values[s] for s in steps if s in values]
    return statistics.median(chosen) if chosen else float("nan")


def save_random_model(
    folder: Path, hidden_size: int = 64, layers: int = 2, shape: dict[str, Any] | None = None, seed: int = 1
) -> int:
    """A randomly initialised Qwen2 with the project's byte-level tokenizer, saved to `folder`; its parameter
    count. `shape`: Qwen2Config's sizes (Qwen2.5-0.5B's, say); else the tiny model's architecture at
    `hidden_size` x `layers` (its defaults are the tiny preset's: a step's cost depends on the shapes, not on
    the weights, and the format warm start takes minutes to build)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from grpo_flow.workers.data.tiny_model import build_model, build_tokenizer

    tokenizer = build_tokenizer()
    if shape is None:
        model = build_model(tokenizer, hidden_size=hidden_size, layers=layers, seed=seed)
    else:
        ids = {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id}
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(Qwen2Config(**shape, **ids, bos_token_id=tokenizer.eos_token_id))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def default_tiny_model() -> str | None:
    """A tiny model already built by `grpo train --preset tiny` under the default storage root, if any."""
    root = Path(os.environ.get("GRPO_FLOW_STORAGE", "grpo-storage"))
    folder = root / "models" / "tiny-qwen2"
    return str(folder) if (folder / "build_info.json").exists() else None


def run_steps_directly(config: Any, plan: Any, first: int, last: int) -> dict[int, float]:
    """Steps first..last of a run by the step's task functions called without Prefect, in the
    order flows/grpo.py calls them (rollouts, actor step, weight sync, metrics, checkpoint): the
    same files as the flow writes. Returns each step's seconds."""
    import dataclasses
    import warnings

    from grpo_flow.tasks.rollout import (
        commit_rollouts,
        compute_advantages,
        generate,
        sample_batch,
        score,
        write_rollouts,
    )
    from grpo_flow.tasks.train import actor_step, log_metrics, save_checkpoint, sync_weights

    plan = dataclasses.replace(plan, total_steps=last, first_step=first, replay_steps=(), resume_checkpoint=None)
    # log_metrics publishes the step's artifact as in the flow, here with no flow run around it, which
    # Prefect 3.8 warns about once per step on the artifact thread (a filter there would not be
    # thread-safe to set from here, so it is set for the process: it is the benchmark's).
    warnings.filterwarnings("ignore", message="Artifact creation outside of a flow or task run", category=FutureWarning)
    from grpo_flow.workers import backends

    backends.start_workers(config, plan.model_path)  # they heal to the run's state at their first call
    rollout_version = first - 1
    seconds = {}
    for step in range(first, last + 1):
        started = time.perf_counter()
        shards = sample_batch.fn(config, plan, step)
        scored = [score.fn(config, plan, generate.fn(config, plan, shard, rollout_version)) for shard in shards]
        batches, stats = compute_advantages(config, scored)
        for index, batch in enumerate(batches):
            write_rollouts(config, plan, batch, index)
        commit_rollouts(config, plan, step)
        metrics = actor_step.fn(config, plan, step, step - 1)
        synced = sync_weights.fn(config, plan) if step % config.sync_weights_every == 0 or step == last else {}
        rollout_version = int(synced.get("synced_version", rollout_version))
        row = {
            "run_id": plan.run_id,
            "step": step,
            "policy_version": step,
            **stats,
            "num_completions": sum(len(b) for b in batches),
            **metrics,
            **synced,
            "step_s": time.perf_counter() - started,
        }
        log_metrics.fn(config, plan, step, row)
        if step % config.save_steps == 0 or step == last:
            save_checkpoint.fn(config, plan, step)
        seconds[step] = time.perf_counter() - started
    return seconds

"""The workers as Ray actors: the plain servers (workers/backends/servers.py) passed to `ray.remote`.

Ray restarts a lost actor by running its constructor again (`max_restarts=-1`), so a restarted
worker holds the initial model; its calls are not retried by Ray (`max_task_retries=0`): every
verb that depends on the weights carries the policy version it expects, and `Workers` heals a
worker that refuses one before calling again. Nothing here imports Ray; ray_backend passes it in.
"""

from __future__ import annotations

from typing import Any

from grpo_flow.workers.backends.servers import ActorServer, RolloutServer

# Weight-sync methods that move a state dict through Ray's object store: a method's return value stays
# in the object store of the actor's node, owned by the caller, so it outlives the actor process and
# every engine takes the same stored copy. The others write files on the shared storage root.
OBJECT_STORE_METHODS = ("reload", "direct")
WORKER_CLASSES: tuple[type, type] = (ActorServer, RolloutServer)


def start_actor(
    ray: Any, cls: type, name: str, cpus: float, gpus: float, placement_group: Any, bundle: int, *args: Any
) -> Any:
    """`cls(*args, device)` as a Ray actor named `name`, in bundle `bundle` of the run's placement group."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    remote = ray.remote(cls).options(
        name=name,
        num_cpus=cpus,
        num_gpus=gpus,
        max_restarts=-1,
        max_task_retries=0,
        scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group, bundle),
    )
    return remote.remote(*args, "cuda" if gpus else "cpu")

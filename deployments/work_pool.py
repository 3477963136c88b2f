"""The same deployments on a work pool, for a worker to run instead of `grpo serve`.

Local process pool (a self-hosted `prefect server start`, or Prefect Cloud):

    export PREFECT_API_URL=http://127.0.0.1:4200/api
    python -m grpo_flow.deployments.work_pool --pool grpo-local --storage-root /data/grpo-storage
    prefect worker start --pool grpo-local          # where grpo-flow is installed (pip install -e .)
    prefect deployment run grpo/tiny --param max_steps=3

The pool is created as a `process` pool if it does not exist. Entrypoints are module paths, so
the worker needs grpo-flow importable (installed, or started from the repository root), and no
code is pushed anywhere: `prefect.deploy(..., build=False, push=False)`. Registering the same
deployment names here and with `grpo serve` against one server makes them one deployment (the
last registration wins): use one or the other per server.

Modal push work pool (Prefect Cloud only; not tested here, this project has no Cloud account):
a push pool needs no worker, Prefect Cloud starts each flow run as a Modal function.

    prefect cloud login
    modal token new                                    # the `modal` package is a grpo-flow dependency
    prefect work-pool create grpo-modal --type modal:push --provision-infra
    python -m grpo_flow.deployments.work_pool --pool grpo-modal --image <registry>/grpo-flow:<tag> --storage-root /vol/grpo

`--provision-infra` (prefect/infrastructure/provisioners/modal.py) reads the local Modal token
and stores it in a Prefect block the pool uses. The image must contain grpo-flow
and its dependencies (`pip install -e .`); the flow run then runs in that container on Modal,
so `storage_root` must be a path that container sees (a Modal Volume mounted through the pool's
job variables). A self-hosted server cannot use push pools: there, run a process worker as
above (the flow itself, with `backend=modal`, is what calls Modal GPUs; see
/work/shared/STACK.md).
"""

from __future__ import annotations

import argparse
import os
import sys
from uuid import UUID

from grpo_flow.deployments.serve import DeploymentSettingsError, build_deployments

DEFAULT_POOL = "grpo-local"


def ensure_process_pool(name: str) -> None:
    """Create a `process` work pool named `name` unless one exists (of any type)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            client.read_work_pool(name)
        except ObjectNotFound:
            client.create_work_pool(WorkPoolCreate(name=name, type="process"))


def deploy_to_work_pool(
    pool: str = DEFAULT_POOL,
    storage_root: str | os.PathLike = "grpo-storage",
    cron: str | None = None,
    timezone: str | None = None,
    k: int | None = None,
    prompts: int | None = None,
    image: str | None = None,
) -> list[UUID]:
    """Register every deployment on `pool` (created as a process pool when missing and no image is
    given); returns the deployment ids. With `image`, the pool must accept images (Docker, Modal push)."""
    from prefect import deploy

    deployments = build_deployments(storage_root, cron, timezone, k, prompts)
    if image is None:
        ensure_process_pool(pool)
    return deploy(
        *deployments,
        work_pool_name=pool,
        image=image,
        build=False,
        push=False,
        print_next_steps_message=False,
        ignore_warnings=True,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m grpo_flow.deployments.work_pool", description="Register grpo-flow's deployments on a work pool."
    )
    parser.add_argument("--pool", default=DEFAULT_POOL, help=f"work pool name (default: {DEFAULT_POOL})")
    parser.add_argument("--storage-root", default=os.environ.get("GRPO_FLOW_STORAGE", "grpo-storage"))
    parser.add_argument(
        "--timezone", default=None, help="time zone of the nightly cron (default: $GRPO_FLOW_NIGHTLY_TZ or UTC)"
    )
    parser.add_argument("--nightly-cron", default=None, help="cron of evaluate/nightly (default: 0 2 * * *)")
    parser.add_argument("--eval-k", type=int, default=None, help="nightly completions per prompt (default: 8)")
    parser.add_argument("--eval-prompts", type=int, default=None, help="nightly held-out prompts per run")
    parser.add_argument("--image", default=None, help="container image, for Docker or Modal push pools")
    args = parser.parse_args(argv)
    try:
        ids = deploy_to_work_pool(
            args.pool, args.storage_root, args.nightly_cron, args.timezone, args.eval_k, args.eval_prompts, args.image
        )
    except DeploymentSettingsError as error:
        print(f"grpo_flow.deployments.work_pool: {error}", file=sys.stderr)
        return 2
    print(
        f"registered {len(ids)} deployments on work pool {args.pool!r}; start a worker with: "
        f"prefect worker start --pool {args.pool}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

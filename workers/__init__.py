"""The workers: plain classes and functions that do the work of a run. None imports Prefect.

Grouped by role; each subpackage has one reason to change, and dependencies point down this
list (a package imports only those below it, plus `schemas`):

    backends/  where workers run: the local backend, the Modal app and its wrappers, weight sync
    actor/     the policy being trained: TRL's objective, advantages, TRL's own loop (simple mode)
    rollout/   engines that generate completions: transformers, out-of-process, vLLM; multi-turn episodes;
               held-out accuracy
    tools/     tools and environments as TRL takes them, and their calls (timeouts, the sandbox)
    rewards/   reward functions as TRL calls them, reward environments, the code sandbox
    data/      task loaders (synthetic and hub data sets) and the project's tiny model
    state/     what a run knows on disk: storage, resume, fault injection, wandb tracking

Only `backends` knows where a worker runs (this process, a child process, a Modal container);
the tasks reach every worker through it.
"""

"""The Python API, in the seeds' (and TRL's) style:

    from grpo_flow.flows.trainer import GRPOFlowTrainer

    trainer = GRPOFlowTrainer(
        model="tiny",                     # the project's offline model, or a hub id / local path
        reward_funcs=[my_reward, MyEnvironment(), "last_digit"],
        reward_weights=[1.0, 0.5, 1.0],
        train_dataset=dataset,            # any datasets.Dataset with a `prompt` column
        max_steps=20, learning_rate=5e-3, # every GRPOFlowConfig field, TRL's names
    )
    summary = trainer.train()

`train()` runs the same `grpo` flow as `grpo train`, so the run is logged, checkpointed and
resumable the same way (call `train()` again with the same run_id to resume). Everything is
checked here, before anything loads.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import ValidationError

from grpo_flow.flows.checks import StartCheckError, absolute_local_paths, check_before_start, check_reward_columns
from grpo_flow.schemas.config import GRPOFlowConfig, InvalidConfigError, describe_validation_error


def _importable_path(func: Any) -> str | None:
    """`module:function` for a module-level function (usable from any process), else None."""
    module, qualname = getattr(func, "__module__", None), getattr(func, "__qualname__", "")
    if not inspect.isfunction(func) or not module or module == "__main__" or "<" in qualname or "." in qualname:
        return None
    return f"{module}:{qualname}"


def _importable_object(obj: Any) -> str | None:
    """`module:name` for a module-level function or class (usable from any process), else None."""
    if inspect.isclass(obj):
        module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", "")
        if module and module != "__main__" and "<" not in qualname and "." not in qualname:
            return f"{module}:{qualname}"
        return None
    return _importable_path(obj)


def tool_entries(tools: Any, environment_factory: Any) -> tuple[list[str], Any, dict[str, Any]]:
    """TRL's `tools` and `environment_factory` as config entries: a module-level function or class as its
    `module:name` path, any other object as `registered:<name>` (returned by name, registered at train());
    strings as they are."""
    objects: dict[str, Any] = {}

    def entry(obj: Any, name: str) -> str:
        if isinstance(obj, str):
            return obj
        path = _importable_object(obj)
        if path is not None:
            return path
        objects[name] = obj
        return f"registered:{name}"

    if tools is not None and (isinstance(tools, str) or callable(tools)):
        tools = [tools]
    tool_list = [entry(t, getattr(t, "__name__", f"tool{i}")) for i, t in enumerate(tools or [])]
    environments: str | dict[str, str] | None
    if environment_factory is None:
        environments = None
    elif isinstance(environment_factory, dict):
        environments = {str(k): entry(v, f"environment.{k}") for k, v in environment_factory.items()}
    else:
        environments = entry(environment_factory, f"environment.{getattr(environment_factory, '__name__', 'factory')}")
    return tool_list, environments, objects


def check_dataset_type(field: str, dataset: Any) -> None:
    """A `datasets.Dataset` (or None); what else users hand over gets the way to make one."""
    if dataset is None:
        return
    from datasets import Dataset, DatasetDict, IterableDataset

    if isinstance(dataset, Dataset):
        return
    kind = type(dataset).__name__
    if isinstance(dataset, DatasetDict):
        how = f"pass one split, e.g. {field}=dataset[{next(iter(dataset), 'train')!r}]"
    elif isinstance(dataset, IterableDataset):
        how = "a run samples prompts by index; load it without streaming, or Dataset.from_list(list(dataset))"
    elif kind == "DataFrame":
        how = "convert it with datasets.Dataset.from_pandas(frame)"
    else:
        how = "make one with datasets.Dataset.from_list or Dataset.from_dict"
    raise StartCheckError(field, f"a {kind}, not a datasets.Dataset; {how}")


class GRPOFlowTrainer:
    """A GRPO run in TRL's style; `train()` runs the `grpo` flow and returns the run's summary.

    model: a hub id, a local folder or `.gguf` file, or a built-in model (`tiny`, `smollm2-135m`, ...).
    reward_funcs: functions called as TRL calls them (`completions`, `prompts`, the data set's columns
        as keywords), reward environments (`score` / `score_batch`), or reward names; a module-level
        function is recorded as `module:function`, so a resumed or deployed run finds it again.
    reward_weights: one weight per reward function (default: 1.0 each).
    train_dataset / eval_dataset: `datasets.Dataset`s with a `prompt` column (text, or chat messages).
    accuracy_reward: the reward (one of reward_funcs, a built-in, or a function) whose 1.0 means
        correct, for held-out accuracy and pass@k.
    tools / environment_factory: TRL's (functions with type hints and docstrings; a class or callable making
        one environment per rollout, or a dict of them chosen by the `environment` column), or their
        `module:name` paths; a module-level one is recorded as its path, others run in this process only.
    config_fields: any `GRPOFlowConfig` field (`max_steps=`, `learning_rate=`, `storage_root=`, ...);
        an unknown one is refused, naming what grpo-flow has instead.
    """

    def __init__(
        self,
        model: str = "tiny",
        reward_funcs: Sequence[Callable[..., Any] | Any | str] | Callable[..., Any] | Any | None = None,
        reward_weights: Sequence[float] | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        accuracy_reward: str | Callable[..., Any] | None = None,
        tools: Sequence[Callable[..., Any] | str] | None = None,
        environment_factory: Any = None,
        **config_fields: Any,
    ):
        from grpo_flow.workers.rewards.environments import as_reward_function, is_reward_environment, snake_case

        funcs = [] if reward_funcs is None else reward_funcs
        if isinstance(funcs, (str, bytes)) or callable(funcs) or is_reward_environment(funcs):
            funcs = [funcs]
        self.reward_objects: dict[str, Callable[..., Any]] = {}
        names: list[str] = []
        registered: list[bool] = []  # objects this process registers for the run, by name
        for index, func in enumerate(funcs):
            if isinstance(func, str):
                names.append(func)
                registered.append(False)
                continue
            path = None
            if is_reward_environment(func):
                name = snake_case(type(func).__name__)
                func = as_reward_function(func, name)
            elif callable(func):
                name = getattr(func, "__name__", None) or snake_case(type(func).__name__)
                path = _importable_path(func)
            else:
                raise TypeError(
                    f"reward_funcs[{index}]: {func!r} is neither callable nor a reward environment "
                    "(an object with score or score_batch), nor a reward name"
                )
            self.reward_objects[name] = func
            names.append(path or name)
            registered.append(path is None)
        if reward_weights is not None and len(reward_weights) != len(names):
            raise StartCheckError(
                "reward_weights", f"{len(reward_weights)} values but reward_funcs has {len(names)} functions"
            )
        for field, value in (("train_dataset", train_dataset), ("eval_dataset", eval_dataset)):
            check_dataset_type(field, value)
        self.task = None
        if train_dataset is not None:
            from grpo_flow.workers.data.loaders import HELDOUT_FRACTION, task_from_dataset  # the CLI's rule too

            accuracy = self._accuracy_function(accuracy_reward, names)
            if eval_dataset is not None and accuracy is None:
                raise StartCheckError(
                    "accuracy_reward",
                    "eval_dataset is scored by accuracy_reward (a reward giving 1.0 when right); name one",
                )
            # Without eval_dataset, 10 % of the distinct prompts are held out for evaluation, unless
            # evaluation is off (eval_prompts=0) or nothing can score it (no accuracy_reward): then
            # every prompt trains.
            evaluates = config_fields.get("eval_prompts", GRPOFlowConfig.model_fields["eval_prompts"].default) != 0
            fraction = HELDOUT_FRACTION if evaluates and accuracy and eval_dataset is None else 0.0
            self.task = task_from_dataset(
                train_dataset,
                eval_dataset,
                name="api",
                heldout_fraction=fraction,
                accuracy_reward=accuracy[0] if accuracy else None,
                accuracy_function=accuracy[1] if accuracy else None,
            )
            key = self._dataset_key(train_dataset, eval_dataset) + ("" if fraction else "-all")
            config_fields["dataset"] = "registered:" + key
        elif isinstance(accuracy_reward, str):  # an hf: data set's, named as `grpo train --accuracy-reward` names it
            config_fields["accuracy_reward"] = accuracy_reward
        elif eval_dataset is not None or accuracy_reward is not None:
            raise StartCheckError(
                "train_dataset",
                "eval_dataset, and an accuracy_reward given as a function, need a train_dataset "
                "(for an hf: data set, name the accuracy reward instead)",
            )
        # Names for the config: importable paths stay as they are; other objects are registered at train().
        config_names = [
            f"registered:{n}" if object_only else n for n, object_only in zip(names, registered, strict=True)
        ]
        if tools is not None or environment_factory is not None:
            config_fields["tools"], config_fields["environment_factory"], self.tool_objects = tool_entries(
                tools, environment_factory
            )
        else:
            self.tool_objects = {}
        fields = {
            **config_fields,
            "model": model,
            "reward_funcs": config_names,
            "reward_weights": list(reward_weights) if reward_weights is not None else None,
        }
        try:
            self.config = GRPOFlowConfig(**absolute_local_paths(fields))  # config.json keeps absolute paths
        except ValidationError as error:
            raise InvalidConfigError(describe_validation_error(error)) from None
        # Reward paths, weights, model path, storage root.
        columns = train_dataset.column_names if train_dataset is not None else None
        check_before_start(
            self.config,
            self.reward_objects,
            registered_dataset=self.task is not None,
            tool_objects=self.tool_objects,
            dataset_columns=columns,
        )
        if columns is not None:  # the functions given as objects, which check_before_start takes by name
            check_reward_columns(self.reward_objects, columns, "train_dataset")
        if self.config.run_id is None:
            from grpo_flow.schemas.config import new_run_id

            self.config = self.config.model_copy(update={"run_id": new_run_id(self.config)})

    def _accuracy_function(
        self, accuracy_reward: str | Callable[..., Any] | None, names: list[str]
    ) -> tuple[str, Callable[..., Any]] | None:
        """The held-out accuracy's scorer as (name, function): one of reward_funcs by name, a built-in
        reward, or a function; None without one."""
        from grpo_flow.workers.rewards.functions import BUILTIN_REWARDS, resolve_reward_funcs, reward_key

        if accuracy_reward is None:
            return None
        keys = [reward_key(name) for name in names]
        if callable(accuracy_reward):
            return getattr(accuracy_reward, "__name__", "accuracy"), accuracy_reward
        if accuracy_reward in keys:
            name = names[keys.index(accuracy_reward)]
            if accuracy_reward in self.reward_objects:
                return accuracy_reward, self.reward_objects[accuracy_reward]
            return accuracy_reward, resolve_reward_funcs([name])[accuracy_reward]
        if accuracy_reward in BUILTIN_REWARDS:
            return accuracy_reward, BUILTIN_REWARDS[accuracy_reward]
        raise StartCheckError(
            "accuracy_reward",
            f"{accuracy_reward!r} is neither one of reward_funcs ({', '.join(keys) or 'none'}) nor a built-in reward",
        )

    @staticmethod
    def _dataset_key(train: Any, heldout: Any) -> str:
        """Same data, same key: a resumed run in a new process sees no config change."""
        keys = [getattr(d, "_fingerprint", None) or str(id(d)) for d in (train, heldout) if d is not None]
        return "-".join(keys)

    def train(self, allow_config_change: bool = False) -> dict[str, Any]:
        """Run (or resume) the `grpo` flow; returns the run's summary.

        Prints nothing of its own: Prefect's console logs and its ephemeral server's output go to
        `<storage_root>/logs/prefect.log` from here on (flows/quiet.py), and a warning meant for the
        user (a step without any reward) is printed as `grpo-flow: warning: ...`.
        """
        from grpo_flow.flows.grpo import grpo
        from grpo_flow.flows.quiet import quiet_libraries, quiet_prefect_run
        from grpo_flow.workers.data.loaders import register_task
        from grpo_flow.workers.rewards.functions import register_reward_funcs

        if self.task is not None:
            register_task(self.config.dataset.removeprefix("registered:"), self.task)
        run_id = self.config.run_id
        assert run_id is not None, "GRPOFlowTrainer names its run before train()"
        register_reward_funcs(run_id, self.reward_objects)
        if self.tool_objects:
            from grpo_flow.workers.tools.toolbox import register_tool_objects

            register_tool_objects(run_id, self.tool_objects)
        quiet_prefect_run(self.config.storage_root)
        with quiet_libraries():
            return grpo(self.config, allow_config_change=allow_config_change)

"""A run's tools and environments, with TRL 1.16's meaning (GRPOTrainer's `tools`, `environment_factory`).

    toolbox = build_toolbox(config.tools, config.environment_factory, run_id)   # ToolError naming the field
    prompt, environment, tools = toolbox.start(row)     # one rollout: its environment reset with the row

- A tool is a plain function with type hints and a Google-style docstring; the chat template shows
  the model its JSON schema (transformers' `get_json_schema`).
- An environment factory is a callable (usually a class) that makes one environment per rollout.
  The environment's public methods are tools; `reset(**row)` is called with the data set row (every
  column; with a dict of factories, all but `environment`) and may return text, appended to the last
  user message; `get_reward()`, if defined, scores the finished rollout (a reward named after the
  class, weight 1, beside `reward_funcs`).
- A dict of factories chooses one per row by its `environment` column; only that environment's
  tools are shown in the row's prompt.

Where grpo-flow differs: TRL keeps a pool of environments and resets them batch after batch; here
every rollout gets a fresh instance (then `reset`), so an environment must not count on being
reused. Entries are `module:function` / `module:Class` paths (CLI, deployments), or the Python API's
objects registered for the run in this process (`registered:<name>`).
"""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

REGISTERED_PREFIX = "registered:"
ENVIRONMENT_COLUMN = "environment"  # TRL's column choosing a row's environment when there are several
NOT_TOOLS = ("reset", "get_reward")  # an environment's methods that are not tools (TRL's rule)

# The Python API's objects, by run: a config holds only their names (`registered:<name>`).
_REGISTERED: dict[str, dict[str, Any]] = {}


class ToolError(ValueError):
    """A tool or environment that cannot be used, said in one line that starts with the field."""


def register_tool_objects(run_id: str, objects: Mapping[str, Any]) -> None:
    """Make tools and environment factories given as Python objects available to a run in this process."""
    _REGISTERED[run_id] = dict(objects)
    _cached_toolbox.cache_clear()


def registered_name(name: str) -> str:
    return REGISTERED_PREFIX + name


def load_object(entry: str, where: str, run_id: str | None, objects: Mapping[str, Any] | None = None) -> Any:
    """`module:name` imported, or `registered:<name>` from the Python API (`objects`, else those registered
    for `run_id`); ToolError naming `where`."""
    if entry.startswith(REGISTERED_PREFIX):
        key = entry.removeprefix(REGISTERED_PREFIX)
        registered = objects if objects is not None else _REGISTERED.get(run_id or "", {})
        if key not in registered:
            raise ToolError(
                f"{where}: {entry!r} was registered by the Python API in another process; run it through "
                "GRPOFlowTrainer, or name it as 'module:name'"
            )
        return registered[key]
    module_name, _, attr = entry.partition(":")
    if not module_name or not attr:
        raise ToolError(f"{where}: {entry!r} is not a 'module:name' import path")
    from grpo_flow.workers.rewards.functions import import_user_module, where_it_looked

    try:  # from the working directory too, as rewards are
        return getattr(import_user_module(module_name), attr)
    except (ImportError, AttributeError) as error:
        raise ToolError(
            f"{where}: cannot import {entry!r}: {one_line(error)}{where_it_looked(error, module_name)}"
        ) from None
    except Exception as error:  # the module itself failed: a syntax error, a missing variable
        raise ToolError(
            f"{where}: importing {module_name!r} for {entry!r} raised {type(error).__name__}: {one_line(error)}"
        ) from None


def one_line(error: BaseException) -> str:
    return " ".join(str(error).split())


def tool_schema(func: Callable[..., Any], where: str) -> dict[str, Any]:
    """The JSON schema the chat template shows the model (transformers' get_json_schema, as TRL renders tools):
    a ToolError naming `where` when type hints or the docstring do not give one."""
    from transformers.utils.chat_template_utils import (
        DocstringParsingException,
        TypeHintParsingException,
        get_json_schema,
    )

    try:
        return get_json_schema(func)
    except (DocstringParsingException, TypeHintParsingException) as error:
        reason = one_line(error).replace("Cannot generate JSON schema for ", "").replace(" because", ":").rstrip("!")
        raise ToolError(
            f"{where}: {reason} (a tool needs type hints and a Google-style docstring with an Args: line per "
            "argument, as TRL's tools do)"
        ) from None


def tool_methods(environment_class: type) -> list[str]:
    """The names of an environment's tools: its public functions but reset and get_reward (TRL's rule,
    read from the class, so properties are not evaluated)."""
    return [
        name
        for name, _ in inspect.getmembers(environment_class, predicate=inspect.isfunction)
        if name not in NOT_TOOLS and not name.startswith("_")
    ]


@dataclass(frozen=True)
class Tool:
    """One tool a rollout may call: `func` is what runs in this process (and what the template renders);
    `path` (`module:function`) is set for a tool that can be imported elsewhere, such as the sandbox."""

    name: str
    func: Callable[..., Any]
    path: str | None = None


@dataclass
class Toolbox:
    """A run's standalone tools and environment factories (None: no environment; a `None` key: one
    environment for every row; names: TRL's dict of factories)."""

    tools: list[Tool]
    factories: dict[str | None, Callable[[], Any]] | None = None
    environment_classes: dict[str | None, type] = field(default_factory=dict)

    @property
    def multi_environment(self) -> bool:
        return self.factories is not None and None not in self.factories

    @property
    def reward_classes(self) -> list[type]:
        """Environment classes that own a reward (`get_reward`), once each, in the order given."""
        seen: list[type] = []
        for cls in self.environment_classes.values():
            if callable(getattr(cls, "get_reward", None)) and cls not in seen:
                seen.append(cls)
        return seen

    @property
    def reward_names(self) -> list[str]:
        """The rewards environments add (TRL names each after its class)."""
        return [cls.__name__ for cls in self.reward_classes]

    def environment_name(self, row: Mapping[str, Any]) -> str | None:
        if not self.multi_environment:
            return None
        name = row.get(ENVIRONMENT_COLUMN)
        assert self.factories is not None
        if name not in self.factories:
            raise ToolError(
                f"dataset: row {row.get('prompt_id')!r} has environment={name!r}, which is not among the "
                f"environments of environment_factory: {sorted(map(str, self.factories))}"
            )
        return name

    def start(self, row: Mapping[str, Any]) -> tuple[list[dict[str, Any]], Any, dict[str, Tool]]:
        """One rollout of `row`: its prompt (the reset's text appended to the last user message, as TRL
        does), its environment instance (None without environments) and the tools it may call, by name."""
        prompt = [dict(message) for message in row["prompt"]]
        tools = {tool.name: tool for tool in self.tools}
        if self.factories is None:
            return prompt, None, tools
        name = self.environment_name(row)
        environment = self.factories[name]()
        kwargs = {k: v for k, v in row.items() if k != ENVIRONMENT_COLUMN} if self.multi_environment else dict(row)
        observation = environment.reset(**kwargs)
        if observation is not None:
            if not isinstance(observation, str):
                raise ToolError(
                    f"environment_factory: {type(environment).__name__}.reset returned {type(observation).__name__}; "
                    "grpo-flow takes text (or None), appended to the last user message"
                )
            prompt[-1] = {**prompt[-1], "content": str(prompt[-1]["content"]) + observation}
        for method in tool_methods(type(environment)):
            tools[method] = Tool(method, getattr(environment, method))
        return prompt, environment, tools

    def rendered(self, tools: Mapping[str, Tool]) -> list[Callable[..., Any]] | None:
        """What the chat template is given as `tools` (None for none: some templates render a tools
        preamble for an empty list, as TRL notes)."""
        return [tool.func for tool in tools.values()] or None


def entry_name(entry: str) -> str:
    return entry.removeprefix(REGISTERED_PREFIX).rpartition(":")[2]


def resolve_tools(entries: Sequence[str], run_id: str | None, objects: Mapping[str, Any] | None = None) -> list[Tool]:
    """The standalone tools, checked: each imports, is callable and has a schema; names are distinct."""
    tools: list[Tool] = []
    for index, entry in enumerate(entries):
        where = f"tools[{index}]"
        func = load_object(entry, where, run_id, objects)
        if not callable(func) or inspect.isclass(func):
            raise ToolError(f"{where}: {entry!r} is not a function")
        schema = tool_schema(func, f"{where} ({entry_name(entry)})")
        name = schema["function"]["name"]
        clash = next((t for t in tools if t.name == name), None)
        if clash is not None:
            first = entries[tools.index(clash)]
            raise ToolError(f"{where}: {entry!r} and {first!r} are both called {name!r}; tool names must differ")
        path = None if entry.startswith(REGISTERED_PREFIX) else entry
        tools.append(Tool(name, func, path))
    return tools


def environment_class(factory: Callable[[], Any], where: str) -> type:
    """The class a factory makes: the factory itself when it is a class, else one instance's (TRL probes
    one instance too)."""
    if inspect.isclass(factory):
        return factory
    if not callable(factory):
        raise ToolError(f"{where}: {factory!r} is neither a class nor a callable that makes an environment")
    try:
        return type(factory())
    except Exception as error:
        raise ToolError(f"{where}: making an environment raised {type(error).__name__}: {one_line(error)}") from None


def check_environment(cls: type, tools: list[Tool], where: str) -> None:
    """An environment TRL would take: a callable reset, tools with schemas, none named like a standalone tool."""
    if not callable(getattr(cls, "reset", None)):
        raise ToolError(f"{where}: {cls.__name__} has no reset method (TRL's environments must define one)")
    standalone = {tool.name for tool in tools}
    for name in tool_methods(cls):
        tool_schema(getattr(cls, name), f"{where} ({cls.__name__}.{name})")
        if name in standalone:
            raise ToolError(
                f"{where}: {cls.__name__}.{name} and the tool {name!r} share a name; tool names must differ"
            )


def resolve_environments(
    spec: str | Mapping[str, str] | None,
    tools: list[Tool],
    run_id: str | None,
    objects: Mapping[str, Any] | None = None,
) -> tuple[dict[str | None, Callable[[], Any]] | None, dict[str | None, type]]:
    """The environment factories (None: none) and the class each makes, checked."""
    if spec is None:
        return None, {}
    entries: dict[str | None, str] = {None: spec} if isinstance(spec, str) else {k: v for k, v in spec.items()}
    if not entries:
        raise ToolError("environment_factory: an empty mapping; give 'module:Class', or name=module:Class pairs")
    factories: dict[str | None, Callable[[], Any]] = {}
    classes: dict[str | None, type] = {}
    for name, entry in entries.items():
        where = "environment_factory" if name is None else f"environment_factory[{name!r}]"
        factory = load_object(entry, where, run_id, objects)
        cls = environment_class(factory, where)
        check_environment(cls, tools, where)
        factories[name], classes[name] = factory, cls
    return factories, classes


def build_toolbox(
    tools: Sequence[str],
    environment_factory: str | Mapping[str, str] | None,
    run_id: str | None,
    objects: Mapping[str, Any] | None = None,
) -> Toolbox:
    """The run's toolbox from its config's entries (`objects`: the Python API's, by registered name, before
    they are registered); ToolError (one line, naming the field) for any problem."""
    resolved = resolve_tools(tools, run_id, objects)
    factories, classes = resolve_environments(environment_factory, resolved, run_id, objects)
    return Toolbox(resolved, factories, classes)


def check_rows(toolbox: Toolbox, split: str, rows: Any) -> None:
    """A data set split the toolbox can play: conversational prompts (tools go through the chat template)
    and, with several environments, an `environment` column naming one of them on every row."""
    columns = list(getattr(rows, "column_names", None) or (rows[0].keys() if len(rows) else []))
    prompts = rows["prompt"] if hasattr(rows, "column_names") else [row["prompt"] for row in rows]
    for index, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            raise ToolError(
                f"dataset: {split} row {index} is plain text; tools and environments need conversational prompts "
                '(lists of {"role", "content"} messages), as TRL\'s tool calling does'
            )
        break
    if not toolbox.multi_environment:
        return
    assert toolbox.factories is not None
    if ENVIRONMENT_COLUMN not in columns:
        raise ToolError(
            f"dataset: environment_factory maps {sorted(map(str, toolbox.factories))}, so every row needs an "
            f"{ENVIRONMENT_COLUMN!r} column choosing one; the {split} split has none"
        )
    names = rows[ENVIRONMENT_COLUMN] if hasattr(rows, "column_names") else [row[ENVIRONMENT_COLUMN] for row in rows]
    for index, name in enumerate(names):
        if name not in toolbox.factories:
            raise ToolError(
                f"dataset: {split} row {index} has environment={name!r}, which is not among the environments of "
                f"environment_factory: {sorted(map(str, toolbox.factories))}"
            )


def toolbox_for(
    tools: Sequence[str], environment_factory: str | Mapping[str, str] | None, run_id: str | None
) -> Toolbox:
    """The run's toolbox, built once per process (environments are probed, modules imported, only then)."""
    return _cached_toolbox(tuple(tools), json.dumps(environment_factory, sort_keys=True), run_id)


@functools.lru_cache(maxsize=16)
def _cached_toolbox(tools: tuple[str, ...], environment_factory: str, run_id: str | None) -> Toolbox:
    return build_toolbox(list(tools), json.loads(environment_factory), run_id)


def clear_toolbox_cache() -> None:
    """Forget toolboxes built so far (a registered object replaced under the same run id)."""
    _cached_toolbox.cache_clear()


def environment_reward_funcs(toolbox: Toolbox) -> dict[str, Callable[..., Any]]:
    """One reward function per environment class that defines `get_reward`, named after the class, with
    TRL's rule: it scores the rollouts whose environment is exactly that class (None for the others)."""
    return {cls.__name__: environment_reward(cls) for cls in toolbox.reward_classes}


@functools.cache  # one function per class, so that it keeps its process (workers/rewards/deadline.py) from step to step
def environment_reward(cls: type) -> Callable[..., Any]:
    """A reward function calling `get_reward()` on each rollout's environment of class `cls` (awaited if async)."""
    if inspect.iscoroutinefunction(getattr(cls, "get_reward", None)):

        async def scores_async(environments: list[Any], **kwargs: Any) -> list[float | None]:
            return [await own_reward(e) if type(e) is cls else None for e in environments]

        return scores_async

    def scores(environments: list[Any], **kwargs: Any) -> list[float | None]:
        return [own_reward(e) if type(e) is cls else None for e in environments]

    return scores


def own_reward(environment: Any) -> Any:
    return environment.get_reward()


def trl_tool_arguments(toolbox: Toolbox) -> dict[str, Any]:
    """The toolbox as TRL's GRPOTrainer takes it: `tools=` (the callables) and `environment_factory=` (the
    factory, or TRL's dict of them); nothing for a run without either."""
    kwargs: dict[str, Any] = {}
    if toolbox.tools:
        kwargs["tools"] = [tool.func for tool in toolbox.tools]
    if toolbox.factories is not None:
        kwargs["environment_factory"] = toolbox.factories[None] if None in toolbox.factories else toolbox.factories
    return kwargs

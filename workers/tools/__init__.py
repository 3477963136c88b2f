"""Tools and environments, as TRL's GRPOTrainer takes them (`tools=`, `environment_factory=`).

- `toolbox`: a run's tools (plain functions with type hints and a Google-style docstring) and
  environments (a class whose public methods are tools, with `reset` and optionally
  `get_reward`), from `module:function` / `module:Class` paths or the Python API's objects,
  checked once before anything loads; the TRL environment contract (one instance per rollout,
  `reset(**row)`, which tools a row sees).
- `calls`: one turn's tool calls run, each bounded by a timeout; a tool that raises, hangs, gets
  bad arguments or returns something other than text becomes a tool message saying so (never a
  failed step). Tools given by path run in the sandbox (workers/rewards/sandbox.py); Python
  objects and environments' methods run in this process.

Imports transformers (lazily) and, from grpo-flow, `rewards` (the sandbox).
"""

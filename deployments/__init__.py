"""Prefect deployments of grpo-flow, and how they are served.

    grpo/tiny  grpo/smol-math  grpo/gsm8k  grpo/math  grpo/mbpp    a GRPO run from a preset (deployments/grpo.py)
    evaluate/nightly                                pass@k of new checkpoints, cron 02:00 (flows/evaluate.py)

Serve them (a process that registers them and runs their flow runs):

    prefect server start --host 127.0.0.1 --port 4200 &      # or Prefect Cloud: prefect cloud login
    export PREFECT_API_URL=http://127.0.0.1:4200/api
    grpo serve --storage-root /data/grpo-storage --timezone Europe/Berlin

then, from anywhere that reaches the server:

    prefect deployment run grpo/tiny --watch
    prefect deployment run grpo/tiny --param max_steps=3 --param run_id=my-run --watch
    prefect deployment run grpo/tiny --params '{"max_steps": 3, "prompts_per_step": 8}'
    prefect deployment run grpo/gsm8k --param config='{"learning_rate": 2e-6, "epsilon_high": null}'
    prefect deployment run grpo/tiny --param run_id=my-run          # resumes my-run where it stopped
    prefect deployment run evaluate/nightly --watch                  # the nightly sweep, now

How parameters override (see deployments/grpo.py): every config field is a parameter of its
own (`--param max_steps=3`; Prefect reads the value as JSON, so quote a string that looks like
a number: `--param run_id='"123"'`), and `config` takes a JSON object of fields (partial or
whole). The server merges a run's parameters over the deployment's shallowly, which is why a
nested `config` alone could not override one field of the preset. The server checks types
against the parameter schema when the run is created; the flow then validates the whole
config and fails naming the field.

Or register them on a work pool for a worker to run (deployments/work_pool.py, which also
documents the Modal push pool of Prefect Cloud):

    python -m grpo_flow.deployments.work_pool --pool grpo-local && prefect worker start --pool grpo-local
"""

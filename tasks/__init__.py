"""Prefect tasks: small functions that call workers and storage.

Each task states its retry and cache policy where it is defined. Tasks pass references
and small records (run plan, step, paths, rollout shards), never models or optimizers.
"""

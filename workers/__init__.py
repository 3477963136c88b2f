"""Stateful engines as plain classes (no Prefect): actor, rollout engines, rewards, storage."""

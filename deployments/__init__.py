"""Prefect deployment definitions (`grpo/<preset>`, `evaluate/nightly`) and the serve entry.

Not built yet: today a run starts with `grpo train` or by calling `flows.grpo.grpo`, on
Prefect's ephemeral server or on the server in PREFECT_API_URL.
"""

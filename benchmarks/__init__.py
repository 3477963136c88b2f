"""Benchmarks, run from a checkout as `python -m benchmarks.NAME` (not part of the installed package): each
compares the sides of one question in one invocation, prints a table and, with `--json FILE`, writes its
figures with the date and the machine (harness.py)."""

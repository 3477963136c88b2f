"""workers/rewards/deadline.py: where a call with a deadline runs."""

import os
import sys
import types

from grpo_flow.workers.rewards.deadline import call_with_deadline


def where(seen):
    seen.append(os.getpid())
    return os.getpid()


def test_a_call_runs_in_a_child_process_unless_cuda_is_in_use(monkeypatch):
    seen = []
    assert call_with_deadline(where, {"seen": seen}, 30) != os.getpid() and seen == []  # forked: changes stay there
    cuda = types.SimpleNamespace(is_initialized=lambda: True)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))  # a process holding a CUDA context
    assert call_with_deadline(where, {"seen": seen}, 30) == os.getpid() and seen == [os.getpid()]

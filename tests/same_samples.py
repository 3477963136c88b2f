"""One check two test folders share: two rollout engines sample the same policy."""

import torch


def assert_same_samples(engine, other, prompts, params):
    """Same completions token for token, and the same sampling log-probs to rounding (seeded sampling)."""
    ours, theirs = engine.generate(prompts, params), other.generate(prompts, params)
    assert ours.completion_token_ids == theirs.completion_token_ids
    for a, b in zip(ours.sampling_logprobs, theirs.sampling_logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=1e-5)

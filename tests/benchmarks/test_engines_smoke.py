"""benchmarks/engines.py runs end to end on a small model: both engines start, generate, agree with
the actor and take every weight-sync method, and the report prints the ratios. One fp32 vLLM
engine (its start is most of this test's time). No timings are asserted."""

from __future__ import annotations

import json

import pytest

from benchmarks.engines import SYNC_METHODS, main


@pytest.mark.vllm
def test_engines_benchmark_measures_both_engines_and_prints_ratios(tmp_path, capsys):
    out = tmp_path / "engines.json"
    argv = ["--hidden-size", "64", "--layers", "1", "--prompts", "2", "--n", "2", "--max-tokens", "4"]
    main([*argv, "--repeats", "1", "--dtypes", "float32", "--json", str(out)])
    engines = json.loads(out.read_text())["engines"]
    assert list(engines) == ["transformers (fp32)", "vLLM (float32)"]
    for row in engines.values():
        assert row["start_s"] > 0 and row["tokens"] > 0 and row["tokens_per_s"] > 0
        assert set(row["sync_s"]) == {*SYNC_METHODS, "in memory"}
        assert row["logprobs_vs_actor"]["tokens"] > 0
    # Both fp32 engines sample from the actor's policy: their log-probs are the actor's (measured ~1e-6).
    assert engines["vLLM (float32)"]["logprobs_vs_actor"]["max"] < 1e-4
    assert engines["transformers (fp32)"]["logprobs_vs_actor"]["max"] < 1e-4
    printed = capsys.readouterr().out
    assert "vLLM (float32) / transformers: tokens/s x" in printed
    assert all(method in printed for method in SYNC_METHODS)


def test_engines_benchmark_refuses_an_unknown_dtype_before_loading(capsys):
    with pytest.raises(SystemExit) as stopped:
        main(["--dtypes", "float16"])
    assert stopped.value.code == 2
    assert "--dtypes" in capsys.readouterr().err

"""Data providers: hub sets through local fixtures in the hub's format, any data set with a prompt column."""

from __future__ import annotations

import json
import re

import pytest
from datasets import Dataset, DatasetDict
from fixtures_hub import (
    GSM8K_ANSWERS,
    MATH500_ANSWERS,
    MATH_ANSWERS,
    MATH_LEVELS,
    MATH_TEST,
    MATH_TRAIN,
    MBPP_SPLITS,
    FixtureHub,
    gsm8k_hub,
    math_hub,
    math_split,
)

import grpo_flow.workers.data.loaders as data
from grpo_flow.workers.data.loaders import (
    clear_task_cache,
    GSM8K_INSTRUCTION,
    KNOWN_TASKS,
    MATH_INSTRUCTION,
    TaskData,
    build_gsm8k,
    build_math,
    build_math500,
    build_mbpp,
    last_boxed,
    load_custom_task,
    load_task,
    math_level,
    task_from_dataset,
)

HUB_BUILDERS = {"gsm8k": build_gsm8k, "math": build_math, "math500": build_math500, "mbpp": build_mbpp}


def key(prompt):
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)


def check_task_shape(task: TaskData) -> None:
    """What every task must satisfy, whatever its source."""
    assert {"prompt_id", "prompt"} <= set(task.train.column_names)
    assert task.heldout.column_names == task.train.column_names  # evaluation reads train's columns on heldout
    ids = list(task.train["prompt_id"]) + list(task.heldout["prompt_id"])
    assert all(isinstance(i, str) and i for i in ids) and len(set(ids)) == len(ids)
    assert {key(p) for p in task.train["prompt"]}.isdisjoint(key(p) for p in task.heldout["prompt"])
    assert len(task.train) > 0 and len(task.heldout) > 0


def check_conversational(prompt, *needles: str) -> None:
    assert isinstance(prompt, list) and len(prompt) == 1
    assert prompt[0]["role"] == "user"
    for needle in needles:
        assert needle in prompt[0]["content"]


# ----------------------------------------------------------------------------- last_boxed


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so $x = \\boxed{12}$.", "12"),
        ("$\\boxed{\\frac{1}{2}}$", "\\frac{1}{2}"),
        ("$\\boxed{\\left( 5, \\frac{3 \\pi}{2} \\right)}.$", "\\left( 5, \\frac{3 \\pi}{2} \\right)"),
        ("\\boxed{\\begin{pmatrix} 2 \\\\ -2 \\end{pmatrix}}", "\\begin{pmatrix} 2 \\\\ -2 \\end{pmatrix}"),
        ("first \\boxed{3}, then finally \\boxed{4}", "4"),
        ("escaped braces: \\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
        ("an unbalanced escaped brace: \\boxed{\\left\\{ x \\right.}", "\\left\\{ x \\right."),
        ("the remainder is $\\boxed 5$.", "5"),
        ("the remainder is \\boxed 5\nand more", "5"),
        ("each one measures $\\fbox{60}$ degrees", "60"),
        ("\\boxed{1} and then \\fbox{2}", "2"),
        ("space before the brace: \\boxed {7}", "7"),
        ("  \\boxed{  -3  }  ", "-3"),
        ("no box at all: 42", None),
        ("truncated: \\boxed{\\frac{1}{2", None),
        ("empty: \\boxed{}", None),
        ("\\boxed", None),
        ("another command: \\boxedanswer{3}", None),
        ("\\boxed{9} then another command \\boxedanswer{3}", "9"),
    ],
)
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


def test_math_level_reads_both_hub_formats():
    assert [math_level(v) for v in ("Level 1", "Level 5", "Level ?", 3)] == [1, 5, None, 3]


# ----------------------------------------------------------------------------- the hub sets


def test_gsm8k_from_hub_fixture():
    hub = FixtureHub()
    task = build_gsm8k(load=hub)
    assert hub.calls == [("openai/gsm8k", "main")]
    assert task.name == "gsm8k" and task.default_rewards == ("gsm8k_accuracy",)
    assert task.accuracy_reward == "gsm8k_accuracy"
    assert task.train.column_names == ["prompt_id", "prompt", "answer"]
    assert list(task.train["answer"]) == GSM8K_ANSWERS["train"]  # commas gone: 8,040 -> 8040
    assert list(task.heldout["answer"]) == GSM8K_ANSWERS["test"]
    assert task.heldout[0]["prompt_id"] == "gsm8k-test-00000"
    check_conversational(task.train[0]["prompt"], "1,250 muffins", GSM8K_INSTRUCTION)
    check_task_shape(task)


def test_math_from_hub_fixture():
    hub = FixtureHub()
    task = build_math(load=hub)
    assert hub.calls == [("DigitalLearningGmbH/MATH-lighteval", "default")]
    assert task.name == "math" and task.default_rewards == ("math_accuracy",)
    assert task.accuracy_reward == "math_accuracy"
    assert task.train.column_names == ["prompt_id", "prompt", "answer", "level", "subject"]
    assert list(task.train["answer"]) == MATH_ANSWERS["train"]
    assert list(task.heldout["answer"]) == MATH_ANSWERS["test"]
    assert list(task.train["level"]) == MATH_LEVELS["train"]  # "Level ?" -> None
    assert list(task.heldout["level"]) == MATH_LEVELS["test"]
    assert list(task.train["subject"]) == [row[3] for row in MATH_TRAIN]
    check_conversational(task.train[1]["prompt"], MATH_TRAIN[1][0], MATH_INSTRUCTION)
    assert "\\boxed{}" in MATH_INSTRUCTION
    check_task_shape(task)


def test_math_rows_without_a_boxed_answer_are_dropped_and_ids_keep_hub_indices():
    rows = [*MATH_TRAIN[:2], ("What is $1+1$?", "Level 1", "It is two.", "Prealgebra", ""), MATH_TRAIN[2]]

    def broken_train():
        return DatasetDict({"train": math_split(rows), "test": math_split(MATH_TEST)})

    task = build_math(load=FixtureHub({"DigitalLearningGmbH/MATH-lighteval": broken_train}))
    assert list(task.train["prompt_id"]) == ["math-train-00000", "math-train-00001", "math-train-00003"]
    assert list(task.train["answer"]) == MATH_ANSWERS["train"][:3]


def test_math500_holds_out_math500_and_trains_on_math_train():
    hub = FixtureHub()
    task = build_math500(load=hub)
    assert set(hub.calls) == {("HuggingFaceH4/MATH-500", None), ("DigitalLearningGmbH/MATH-lighteval", "default")}
    assert task.name == "math500" and task.default_rewards == ("math_accuracy",)
    assert list(task.heldout["answer"]) == MATH500_ANSWERS  # MATH-500's own answer column
    assert list(task.heldout["subject"]) == ["Prealgebra", "Algebra", "Precalculus"]
    assert list(task.heldout["level"]) == [2, 3, 3]
    assert task.heldout[0]["prompt_id"] == "math500-test-00000"
    assert list(task.train["prompt_id"]) == [f"math-train-{i:05d}" for i in range(len(MATH_TRAIN))]
    check_conversational(task.heldout[0]["prompt"], MATH_TEST[0][0], MATH_INSTRUCTION)
    check_task_shape(task)


def test_math500_drops_training_problems_it_holds_out():
    from fixtures_hub import math500_hub

    # The same problem as MATH train row 1, with different whitespace.
    overlap = "Solve for  $x$:\n$\\frac{x}{x+1} = \\frac{1}{3}$."
    task = build_math500(load=FixtureHub({"HuggingFaceH4/MATH-500": lambda: math500_hub((overlap,))}))
    assert "math-train-00001" not in task.train["prompt_id"]
    assert len(task.train) == len(MATH_TRAIN) - 1 and len(task.heldout) == 4
    check_task_shape(task)


def test_mbpp_from_hub_fixture():
    hub = FixtureHub()
    task = build_mbpp(load=hub)
    assert hub.calls == [("google-research-datasets/mbpp", "full")]
    assert task.name == "mbpp" and task.default_rewards == ("mbpp_tests",) and task.accuracy_reward == "mbpp_tests"
    assert task.train.column_names == [
        "prompt_id",
        "prompt",
        "task_id",
        "test_list",
        "test_setup_code",
        "challenge_test_list",
    ]
    # Train = train + validation; held-out = test; the few-shot `prompt` split is left out.
    assert list(task.train["prompt_id"]) == ["mbpp-601", "mbpp-602", "mbpp-603", "mbpp-511"]
    assert list(task.heldout["prompt_id"]) == ["mbpp-11", "mbpp-12", "mbpp-13"]
    row = task.heldout[1]
    source = MBPP_SPLITS["test"][1]
    assert row["test_list"] == source["test_list"] and row["test_setup_code"] == "import math"
    check_conversational(row["prompt"], source["text"], source["test_list"][0], "```python")
    assert source["test_list"][1] not in row["prompt"][0]["content"]  # only the first test is shown
    assert task.heldout[2]["challenge_test_list"] == MBPP_SPLITS["test"][2]["challenge_test_list"]
    check_task_shape(task)


@pytest.mark.parametrize("name", sorted(HUB_BUILDERS))
def test_load_task_builds_each_hub_task_through_datasets_load_dataset(name, monkeypatch):
    hub = FixtureHub()
    monkeypatch.setattr(data, "load_dataset", hub)
    clear_task_cache()
    try:
        task = load_task(name)
    finally:
        clear_task_cache()  # keep fixture-built tasks out of other tests' cache
    assert task.name == name and hub.calls
    check_task_shape(task)


def test_hub_set_in_another_format_is_a_clear_error():
    def renamed():
        hub = gsm8k_hub()
        return DatasetDict({s: d.rename_column("answer", "solution") for s, d in hub.items()})

    with pytest.raises(ValueError, match=r"openai/gsm8k: split 'train' lacks columns \['answer'\]"):
        build_gsm8k(load=FixtureHub({"openai/gsm8k": renamed}))
    with pytest.raises(ValueError, match=r"no 'test' split \(splits: train\)"):
        build_math(
            load=FixtureHub({"DigitalLearningGmbH/MATH-lighteval": lambda: DatasetDict({"train": math_hub()["train"]})})
        )
    with pytest.raises(ValueError, match="returned Dataset, expected a DatasetDict"):
        build_gsm8k(load=FixtureHub({"openai/gsm8k": lambda: gsm8k_hub()["train"]}))


def test_load_task_knows_its_names_and_refuses_others():
    assert KNOWN_TASKS == (
        "last_digit",
        "reverse_digits",
        "digit_lookup",
        "smol_math",
        "gsm8k",
        "math",
        "math500",
        "mbpp",
    )
    known = "known: last_digit, reverse_digits, digit_lookup, smol_math, gsm8k, math, math500, mbpp"
    with pytest.raises(ValueError, match=f"unknown task 'nope'; {known}"):
        load_task("nope")


def test_last_digit_still_builds_with_its_shape():
    check_task_shape(load_task("last_digit"))


def test_reverse_digits_is_fixed_disjoint_and_answers_are_the_digits_backwards():
    task = load_task("reverse_digits")
    check_task_shape(task)
    assert (len(task.train), len(task.heldout)) == (4000, 500)
    assert task.default_rewards == ("reverse_digits_partial",) and task.accuracy_reward == "reverse_digits"
    for prompt, answer in zip(task.train["prompt"], task.train["answer"], strict=True):
        digits = prompt[:-1]
        assert prompt.endswith("<") and digits.isdigit() and 3 <= len(digits) <= 6
        assert answer == digits[::-1]
    # Built by code from a fixed seed: the same rows in a fresh build, whatever else ran before.
    fresh = data.build_reverse_digits()
    assert fresh.train["prompt"] == task.train["prompt"] and fresh.heldout["prompt"] == task.heldout["prompt"]
    assert fresh.heldout["answer"] == task.heldout["answer"]
    # Its own stream: not last_digit's prompts with another end marker.
    last = load_task("last_digit")
    assert [p[:-1] for p in task.train["prompt"][:50]] != [p[:-1] for p in last.train["prompt"][:50]]


def test_synthetic_tasks_draw_format_answers_that_are_not_the_answer():
    import random

    rng = random.Random(0)
    reverse = load_task("reverse_digits")
    drawn = [
        (reverse.format_answer(p, rng), p, a)
        for p, a in zip(reverse.train["prompt"][:400], reverse.train["answer"][:400], strict=True)
    ]
    # The format: every digit of the prompt, once each, in some order (so the right length) ...
    assert all(sorted(guess) == sorted(prompt[:-1]) for guess, prompt, _ in drawn)
    # ... and the right order only by chance (1/n! or better for repeated digits: about 0.1 here).
    assert sum(guess == answer for guess, _, answer in drawn) / len(drawn) < 0.2
    last = load_task("last_digit")
    guesses = [
        (last.format_answer(p, rng), p, a)
        for p, a in zip(last.train["prompt"][:400], last.train["answer"][:400], strict=True)
    ]
    assert all(guess in prompt[:-1] for guess, prompt, _ in guesses)
    assert sum(guess == answer for guess, _, answer in guesses) / len(guesses) < 0.5


# ----------------------------------------------------------------------------- any data set with a prompt column


def plain_rows(count: int) -> Dataset:
    return Dataset.from_dict(
        {"prompt": [f"{i}+{i}=" for i in range(count)], "answer": [str(2 * i) for i in range(count)]}
    )


def test_task_from_dataset_plain_prompts_split_by_fraction():
    task = task_from_dataset(plain_rows(40), name="sums", heldout_fraction=0.25, default_rewards=("mod:f",))
    assert (len(task.train), len(task.heldout)) == (30, 10)
    assert task.train.column_names == ["prompt_id", "prompt", "answer"] and task.extra_columns == ["answer"]
    assert task.default_rewards == ("mod:f",) and task.accuracy_reward is None
    for row in task.train:  # every other column stays with its own row
        assert row["prompt_id"].startswith("sums-") and row["answer"] == str(2 * int(row["prompt"].split("+")[0]))
    check_task_shape(task)
    again = task_from_dataset(plain_rows(40), name="sums", heldout_fraction=0.25)
    assert list(again.heldout["prompt_id"]) == list(task.heldout["prompt_id"])  # the same split every time


def test_task_from_dataset_keeps_duplicate_prompts_on_one_side():
    rows = Dataset.from_dict({"prompt": ["a", "b", "a", "c", "b", "d"], "answer": list("123456")})
    task = task_from_dataset(rows, heldout_fraction=0.5)
    assert len(task.train) + len(task.heldout) == 6
    check_task_shape(task)


def test_task_from_dataset_conversational_with_given_heldout():
    def convo(texts):
        return Dataset.from_dict(
            {
                "prompt": [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": t}] for t in texts],
                "answer": [t.upper() for t in texts],
                "meta": [{"source": "x", "n": i} for i in range(len(texts))],
            }
        )

    task = task_from_dataset(convo(["a", "b", "c"]), convo(["d", "e"]), name="chat", accuracy_reward="acc")
    assert list(task.train["prompt_id"]) == ["chat-train-00000", "chat-train-00001", "chat-train-00002"]
    assert list(task.heldout["prompt_id"]) == ["chat-heldout-00000", "chat-heldout-00001"]
    assert task.heldout[1]["prompt"][1] == {"role": "user", "content": "e"}
    assert task.heldout[1]["meta"] == {"source": "x", "n": 1} and task.accuracy_reward == "acc"
    check_task_shape(task)


def test_task_from_dataset_keeps_existing_prompt_ids_as_strings():
    rows = plain_rows(10).add_column("prompt_id", list(range(100, 110)))
    task = task_from_dataset(rows, heldout_fraction=0.2)
    assert sorted(list(task.train["prompt_id"]) + list(task.heldout["prompt_id"])) == [str(i) for i in range(100, 110)]
    check_task_shape(task)


@pytest.mark.parametrize(
    "rows, message",
    [
        ({"question": ["q"], "answer": ["a"]}, r"custom: train: no 'prompt' column \(columns: question, answer\)"),
        ({"prompt": ["fine", "   ", "fine too"]}, "custom: train row 1: prompt is empty"),
        ({"prompt": ["fine", None]}, r"custom: train row 1: prompt is missing \(None\)"),
        ({"prompt": [[{"role": "user", "content": "hi"}], []]}, "custom: train row 1: prompt is an empty list"),
        (
            {"prompt": [[{"role": "user", "content": "hi"}], [{"role": "user"}]]},
            "custom: train row 1: prompt message 0 lacks 'content'",
        ),
        (
            {"prompt": [[{"content": "hi"}], [{"content": "there"}]]},
            "custom: train row 0: prompt message 0 lacks 'role'",
        ),
        (
            {"prompt": [[{"role": "user", "content": "hi"}, {"role": " ", "content": "x"}]]},
            "custom: train row 0: prompt message 1 has an empty 'role'",
        ),
        ({"prompt": [[{"role": "user", "content": " "}]]}, "custom: train row 0: prompt messages have no content"),
        ({"prompt": [3, 4]}, "custom: train row 0: prompt is a int; expected a string or a list of messages"),
        ({"prompt": [["just", "strings"]]}, "custom: train row 0: prompt message 0 is a str"),
        ({"prompt": ["a", "b"], "completion": ["x", "y"]}, r"columns \['completion'\] clash with rollout log fields"),
        (
            {"prompt": ["a", "b"], "completions": ["x", "y"], "log_metric": [1, 2]},
            r"columns \['completions', 'log_metric'\] clash with the arguments reward functions are called with",
        ),
        ({"prompt": ["a", "b", "c"], "prompt_id": ["p1", "p2", "p1"]}, "prompt_id 'p1' is not unique"),
        ({"prompt": ["a", "a"]}, "needs at least 2 distinct prompts"),
    ],
)
def test_task_from_dataset_errors_name_the_column_or_row(rows, message):
    with pytest.raises(ValueError, match=message):
        task_from_dataset(Dataset.from_dict(rows), heldout_fraction=0.5)


def test_task_from_dataset_errors_on_the_heldout_split():
    train = plain_rows(4)
    with pytest.raises(ValueError, match=r"custom: heldout: no 'prompt' column"):
        task_from_dataset(train, Dataset.from_dict({"text": ["x"]}))
    with pytest.raises(ValueError, match="custom: heldout row 0: prompt is empty"):
        task_from_dataset(train, Dataset.from_dict({"prompt": [""], "answer": ["0"]}))
    with pytest.raises(ValueError, match=r"1 prompt\(s\) are in both train and heldout \(first: heldout row 1\)"):
        task_from_dataset(train, Dataset.from_dict({"prompt": ["new=", "2+2="], "answer": ["0", "4"]}))
    with pytest.raises(ValueError, match=r"heldout lacks the train columns \['answer'\]"):
        task_from_dataset(train, Dataset.from_dict({"prompt": ["new="]}))
    with pytest.raises(ValueError, match="heldout_fraction must be between 0 and 1"):
        task_from_dataset(train, heldout_fraction=1.0)


def test_load_custom_task_from_disk_file_and_hub_id(tmp_path):
    DatasetDict({"train": plain_rows(6), "test": Dataset.from_dict({"prompt": ["x="], "answer": ["?"]})}).save_to_disk(
        tmp_path / "saved"
    )
    task = load_custom_task(str(tmp_path / "saved"))
    assert task.name == "saved" and (len(task.train), len(task.heldout)) == (6, 1)
    check_task_shape(task)

    plain_rows(10).save_to_disk(tmp_path / "single")
    task = load_custom_task(str(tmp_path / "single"), name="single", heldout_fraction=0.3)
    assert (len(task.train), len(task.heldout)) == (7, 3)

    lines = [json.dumps({"prompt": [{"role": "user", "content": f"q{i}"}], "answer": str(i)}) for i in range(5)]
    (tmp_path / "rows.jsonl").write_text("\n".join(lines) + "\n")
    task = load_custom_task(str(tmp_path / "rows.jsonl"), heldout_fraction=0.2, default_rewards=("m:f",))
    assert task.name == "rows" and (len(task.train), len(task.heldout)) == (4, 1)
    check_conversational(task.heldout[0]["prompt"], "q")

    def someone_prompts() -> DatasetDict:
        return DatasetDict({"train": plain_rows(5), "validation": plain_rows(8).select(range(5, 8))})

    hub = FixtureHub({"someone/prompts": someone_prompts})
    task = load_custom_task("someone/prompts", load=hub)
    assert hub.calls == [("someone/prompts", None)] and task.name == "someone_prompts"
    assert (len(task.train), len(task.heldout)) == (5, 3)  # `validation` used as held-out
    with pytest.raises(ValueError, match=r"someone/prompts: no 'heldout' split \(splits: train, validation\)"):
        load_custom_task("someone/prompts", heldout_split="heldout", load=hub)


def test_smol_math_is_generated_in_gsm8ks_format_and_read_by_the_gsm8k_loader():
    from grpo_flow.workers.data.loaders import GSM8K_INSTRUCTION, build_smol_math, smol_math_rows
    from grpo_flow.workers.rewards.functions import gsm8k_accuracy

    raw = smol_math_rows()
    assert (len(raw["train"]), len(raw["test"])) == (224, 100)  # 81 sums x 4 phrasings
    assert raw["train"][0]["answer"].split("\n")[-1].startswith("#### ")  # GSM8K's reference format
    assert not set(raw["train"]["question"]) & set(raw["test"]["question"])
    assert smol_math_rows()["test"]["question"] == raw["test"]["question"]  # the same split every run
    task = build_smol_math()
    assert task.name == "smol_math" and task.default_rewards == ("gsm8k_accuracy",)
    assert task.accuracy_reward == "gsm8k_accuracy" and task.heldout[0]["prompt_id"] == "smol_math-test-00000"
    row = task.train[0]
    question = raw["train"][0]["question"]
    assert row["prompt"] == [{"role": "user", "content": f"{question}\n{GSM8K_INSTRUCTION}"}]  # the gsm8k prompt
    a, b = (int(n) for n in re.findall(r"\d", question))
    assert row["answer"] == str(a + b)
    assert gsm8k_accuracy([f"{a} + {b} = {a + b}", "The answer is 0."], [row["answer"]] * 2) == [1.0, 0.0]


def test_a_data_file_that_is_empty_malformed_or_missing_is_named_in_one_line(tmp_path, monkeypatch):
    """`datasets` said `coroutine raised StopIteration` for an empty file, a DatasetGenerationError naming no
    line for a bad one, and took `missing.jsonl` for a hub id (issue 30, item 12)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "1=", "answer": "1"}\n\n{"prompt": "2=", "answer" "2"}\n')
    (tmp_path / "list.jsonl").write_text('{"prompt": "1=", "answer": "1"}\n["2=", "2"]\n')
    expected = {
        "empty.jsonl": "empty.jsonl: the file is empty (no rows)",
        "bad.jsonl": "bad.jsonl: line 3 is not JSON (Expecting ':' delimiter, column 27)",
        "list.jsonl": "list.jsonl: line 2 is a JSON list, not an object of columns",
        "missing.jsonl": "missing.jsonl: no such file",
    }
    for name, message in expected.items():
        with pytest.raises(ValueError) as raised:
            data.load_custom_task(name, load=lambda *a, name=name, **k: pytest.fail(f"{name} reached the loader"))
        assert str(raised.value) == message


def test_converting_rows_draws_no_progress_bar_and_leaves_datasets_bars_as_they_were(capfd):
    from datasets.utils import logging as datasets_logging

    datasets_logging.enable_progress_bar()
    split = Dataset.from_dict({"question": ["What is 1 + 1?"] * 3, "answer": ["1 + 1 = 2\n#### 2"] * 3})
    rows = data.gsm8k_rows(split, "q")
    assert rows["answer"] == ["2", "2", "2"]
    assert "Map" not in capfd.readouterr().err
    assert datasets_logging.is_progress_bar_enabled()
    split.map(lambda row: row)  # datasets' own call, outside a loader, still shows its bar
    assert "Map" in capfd.readouterr().err


def test_reading_a_new_data_file_draws_no_progress_bar(tmp_path, capfd):
    """The first read of a local `hf:` file, which datasets converts to its cache, printed
    "Generating train split: 120 examples" on stderr."""
    from datasets.utils import logging as datasets_logging

    datasets_logging.enable_progress_bar()
    lines = [json.dumps({"prompt": f"{i}=", "answer": str(i % 10)}) for i in range(20)]
    (tmp_path / "rows.jsonl").write_text("\n".join(lines) + "\n")
    task = load_custom_task(str(tmp_path / "rows.jsonl"), heldout_fraction=0.2, default_rewards=("m:f",))
    assert len(task.train) + len(task.heldout) == 20
    assert "Generating" not in capfd.readouterr().err
    assert datasets_logging.is_progress_bar_enabled()

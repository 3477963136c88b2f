"""A local data set's columns read from its schema or first rows (workers/data/loaders.py data_columns), and
plain-string prompts as user messages (with_user_messages)."""

import json

from datasets import Dataset

from grpo_flow.workers.data.loaders import (
    COLUMN_CHECK_ROWS,
    data_columns,
    load_task,
    task_from_dataset,
    with_user_messages,
)


def test_columns_come_from_the_schema_or_the_first_rows(tmp_path):
    rows = Dataset.from_dict({"prompt": ["1="], "answer": ["1"]})
    rows.to_parquet(tmp_path / "d.parquet")
    rows.to_csv(tmp_path / "d.csv", index=False)
    rows.save_to_disk(str(tmp_path / "one"))
    rows.save_to_disk(str(tmp_path / "arrow"))
    from datasets import DatasetDict

    DatasetDict({"train": rows, "test": rows.remove_columns("answer")}).save_to_disk(str(tmp_path / "splits"))
    arrow = next((tmp_path / "arrow").glob("*.arrow")).rename(tmp_path / "d.arrow")
    for path in ("d.parquet", "d.csv", "one", "splits", arrow):
        assert data_columns(tmp_path / path) == ["prompt", "answer"], path


def test_json_lines_columns_are_the_keys_of_the_first_rows_in_order(tmp_path):
    lines = [{"prompt": "1="}, {"prompt": "2=", "answer": "2"}] * (COLUMN_CHECK_ROWS // 2)
    lines.append({"prompt": "3=", "late": "past the rows read"})
    (tmp_path / "d.jsonl").write_text("\n".join(map(json.dumps, lines)) + "\n")
    assert data_columns(tmp_path / "d.jsonl") == ["prompt", "answer"]
    (tmp_path / "array.json").write_text(json.dumps(lines, indent=1))  # one document: read where it loads
    assert data_columns(tmp_path / "array.json") is None


def test_string_prompts_become_user_messages_and_messages_stay():
    task = task_from_dataset(
        Dataset.from_dict({"prompt": ["1=", "2=", "3="], "answer": ["1", "2", "3"]}), None, "t", 0.34
    )
    wrapped = with_user_messages(task)
    assert wrapped.train["prompt"][0] == [{"role": "user", "content": task.train["prompt"][0]}]
    assert wrapped.heldout["prompt"] == [[{"role": "user", "content": p}] for p in task.heldout["prompt"]]
    assert wrapped.train["answer"] == task.train["answer"] and wrapped.train["prompt_id"] == task.train["prompt_id"]
    chat = load_task("digit_lookup")
    assert with_user_messages(chat) is chat

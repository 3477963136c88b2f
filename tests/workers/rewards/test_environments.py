"""Reward environments, called as TRL calls reward functions: sync and async, math, code tests, format, judge."""

import asyncio
import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from grpo_flow.workers.rewards.environments import (
    CodeExecutor,
    CodeTestsEnvironment,
    LLMJudgeEnvironment,
    MathAnswerEnvironment,
    RewardEnvironment,
    answer_tag_format,
    as_reward_function,
    extract_code,
    extract_math_answer,
    is_reward_environment,
    parse_judge_score,
    think_answer_format,
)
from grpo_flow.workers.rewards.functions import check_scores
from grpo_flow.workers.rewards.sandbox import LocalSandbox, SandboxLimits, SandboxResult


def conversation(text):
    return [{"role": "assistant", "content": text}]


# --------------------------------------------------------------------------- the adapter


class LengthEnvironment(RewardEnvironment):
    """Sync: the completion's length, None where the sample says it does not apply."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def score(self, completion, prompt, applies, **columns):
        self.calls.append((completion, prompt, applies, columns))
        return float(len(completion)) if applies else None


class SlowAsyncEnvironment(RewardEnvironment):
    """Async: each sample takes 0.3 s; gathered, a batch takes about as long as one sample."""

    async def score(self, completion, prompt, bonus, **columns):
        await asyncio.sleep(0.3)
        return 1.0 + bonus if completion == "yes" else None


class AsyncBatchEnvironment(RewardEnvironment):
    async def score_batch(self, completions, prompts, **columns):
        await asyncio.sleep(0)
        return [float(c.count("a")) for c in completions]


class DuckEnvironment:
    """Not a RewardEnvironment, but it has a `score`."""

    def score(self, completion, prompt, **columns):
        return 0.5


def test_sync_environment_with_string_and_conversational_completions():
    env = LengthEnvironment()
    reward = as_reward_function(env)
    assert reward.__name__ == "length_environment"
    trainer_state = object()
    scores = reward(
        prompts=["p0", "p1", "p2"],
        completions=[
            "abc",
            conversation("ignored"),
            [{"role": "user", "content": "x"}, {"role": "assistant", "content": "hello"}],
        ],
        completion_ids=[[1], [2], [3]],
        applies=[True, False, True],
        trainer_state=trainer_state,
    )
    assert scores == [3.0, None, 5.0]
    assert check_scores(reward.__name__, scores, 3)[0] == 3.0  # what the project's scorer accepts
    completion, prompt, applies, columns = env.calls[2]
    assert (completion, prompt, applies) == ("hello", "p2", True)
    # Per-sample columns arrive sliced; anything else (TRL's trainer_state) arrives as is.
    assert columns["completion_ids"] == [3] and columns["trainer_state"] is trainer_state


def test_async_environment_runs_samples_concurrently_and_none_passes_through():
    reward = as_reward_function(SlowAsyncEnvironment(), name="slow")
    assert reward.__name__ == "slow"
    started = time.monotonic()
    scores = reward(
        prompts=["p"] * 5, completions=["yes", "no", conversation("yes"), "yes", "no"], bonus=[0, 0, 1, 2, 0]
    )
    assert scores == [1.0, None, 2.0, 3.0, None]
    assert time.monotonic() - started < 1.2  # five 0.3 s samples, gathered (1.5 s one by one)


def test_async_environment_from_inside_a_running_event_loop():
    reward = as_reward_function(AsyncBatchEnvironment())

    async def caller():
        return reward(prompts=["p", "p"], completions=["banana", conversation("cab")])

    assert asyncio.run(caller()) == [3.0, 1.0]


def test_what_counts_as_an_environment():
    assert is_reward_environment(LengthEnvironment()) and is_reward_environment(DuckEnvironment())
    assert not is_reward_environment(LengthEnvironment) and not is_reward_environment(think_answer_format)
    assert as_reward_function(DuckEnvironment())(prompts=["p"], completions=["c"]) == [0.5]
    with pytest.raises(TypeError):
        as_reward_function(think_answer_format)


def test_a_wrong_number_of_scores_is_an_error():
    class Broken(RewardEnvironment):
        def score_batch(self, completions, prompts, **columns):
            return [1.0]

    with pytest.raises(ValueError, match="1 scores for 2 completions"):
        as_reward_function(Broken())(prompts=["a", "b"], completions=["a", "b"])


# --------------------------------------------------------------------------- math


@pytest.mark.parametrize(
    ("completion", "gold", "expected"),
    [
        ("So the answer is $\\boxed{\\frac{1}{2}}$.", "0.5", 1.0),
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("\\boxed{1/2}", "\\dfrac12", 1.0),
        ("First \\boxed{3}, no wait: \\boxed{\\frac{2}{4}}", "1/2", 1.0),  # the last box counts
        ("She pays 1,234 dollars.\n#### 1,234", "1234", 1.0),
        ("\\boxed{x^2 + 1}", "1 + x^2", 1.0),
        ("\\boxed{2^{1/2}}", "\\sqrt{2}", 1.0),
        ("\\boxed{0.49}", "1/2", 0.0),
        ("#### 41", "42", 0.0),
        ("The answer is 42.", "42", 0.0),  # no boxed or #### answer
        ("\\boxed{}", "42", 0.0),
    ],
)
def test_math_answers_are_compared_as_values(completion, gold, expected):
    reward = as_reward_function(MathAnswerEnvironment())
    assert reward(prompts=["q"], completions=[conversation(completion)], answer=[gold]) == [expected]


def test_math_without_gold_does_not_apply_and_the_column_is_configurable():
    reward = as_reward_function(MathAnswerEnvironment(answer_column="solution"), name="math")
    assert reward(prompts=["q", "q"], completions=["\\boxed{7}", "\\boxed{7}"], solution=["7", None]) == [1.0, None]
    assert extract_math_answer("a \\boxed{\\{1, 2\\}} b") == "\\{1, 2\\}"
    assert extract_math_answer("#### 5\nmore text") == "5"


def test_math_scoring_works_off_the_main_thread():
    # Prefect runs tasks in worker threads, where math_verify's SIGALRM timeouts cannot be set.
    reward = as_reward_function(MathAnswerEnvironment())
    out = {}
    worker = threading.Thread(
        target=lambda: out.update(s=reward(prompts=["q"], completions=["\\boxed{0.5}"], answer=["1/2"]))
    )
    worker.start()
    worker.join()
    assert out["s"] == [1.0]


# --------------------------------------------------------------------------- code tests

MBPP_TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(10, 5) == 15"]


def fenced(code):
    return f"Here is my solution:\n```python\n{code}\n```\nIt adds the numbers."


@pytest.fixture(scope="module")
def code_sandbox():
    return LocalSandbox(SandboxLimits(timeout_s=5.0, cpu_s=5.0))


def test_code_extraction():
    assert extract_code("```python\na = 1\n```\ntext\n```python\nb = 2\n```") == "b = 2\n"
    assert extract_code("intro\n```py\nc = 3\n") == "c = 3\n"  # generation stopped inside the block
    assert extract_code("def f():\n    return 1") == "def f():\n    return 1"


def test_code_tests_all_or_nothing_and_partial_credit(code_sandbox):
    completions = [
        fenced("def add(a, b):\n    return a + b"),
        fenced("def add(a, b):\n    return a + b if a > 0 else 99"),  # passes tests 0 and 2
        conversation(
            fenced("def add(a, b):\n    print('@@grpo-test PASS 1')\n    return -7")
        ),  # fake markers do not count
        fenced("def add(a, b)\n    return a + b"),  # syntax error: a crash
        "no code at all",
    ]
    columns = {"test_list": [MBPP_TESTS] * 4 + [[]], "test_setup_code": ["import math"] * 5}
    strict = as_reward_function(CodeTestsEnvironment(sandbox=code_sandbox, failure_score=-1.0))
    partial = as_reward_function(CodeTestsEnvironment(partial_credit=True, sandbox=code_sandbox, failure_score=-1.0))
    assert strict(prompts=["p"] * 5, completions=completions, **columns) == [1.0, 0.0, 0.0, -1.0, None]
    assert partial(prompts=["p"] * 5, completions=completions, **columns) == pytest.approx(
        [1.0, 2 / 3, 0.0, -1.0, None]
    )


def test_code_tests_use_the_setup_code(code_sandbox):
    env = CodeTestsEnvironment(sandbox=code_sandbox)
    completion = fenced("def root(x):\n    return math.sqrt(x)")
    assert env.score(completion, "p", test_list=["assert root(9) == 3"], test_setup_code="import math") == 1.0
    assert env.score(completion, "p", test_list=["assert root(9) == 3"], test_setup_code="") == 0.0


def test_an_infinite_loop_scores_the_failure_score_quickly(code_sandbox):
    env = CodeTestsEnvironment(timeout_s=1.0, failure_score=-0.5, sandbox=code_sandbox)
    started = time.monotonic()
    scores = as_reward_function(env)(
        prompts=["p"], completions=[fenced("def add(a, b):\n    while True:\n        pass")], test_list=[MBPP_TESTS]
    )
    assert scores == [-0.5]
    assert time.monotonic() - started < 3.0


def test_any_code_executor_can_run_the_tests():
    class RecordingExecutor:
        """Stands in for a remote backend: same run / run_batch, canned results."""

        def __init__(self):
            self.programs = []

        def run(self, code, *, stdin="", timeout_s=None, files=None):
            return SandboxResult("1\n", "", 0, None, 0.01, False)

        def run_batch(self, codes, *, stdins=None, timeout_s=None, files=None):
            self.programs.extend(codes)
            marker = codes[0].rsplit("'", 2)[-2]  # the harness's marker is its last string literal
            return [SandboxResult(f"{marker} PASS 0\n", "", 0, None, 0.01, False)]

    executor = RecordingExecutor()
    assert isinstance(executor, CodeExecutor)
    env = CodeTestsEnvironment(partial_credit=True, sandbox=executor)
    assert env.score(fenced("x = 1"), "p", test_list=["assert x == 1", "assert x == 2"]) == 0.5
    assert "x = 1" in executor.programs[0] and env.execute_in_sandbox("print(1)").exit_code == 0


# --------------------------------------------------------------------------- format


def test_format_rewards():
    completions = [
        "<think>a + b</think>\n<answer>3</answer>",
        conversation("<think>x</think><answer>y</answer>\n"),
        "<answer>3</answer>",
        "preamble <think>x</think><answer>y</answer>",
        "<think>x</think><answer>y</answer><answer>z</answer>",
        "<think>x</think>",
    ]
    assert think_answer_format(completions) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert answer_tag_format(completions=completions, prompts=["p"] * 6) == [1.0, 1.0, 1.0, 1.0, 1.0, 0.0]


# --------------------------------------------------------------------------- LLM judge


class JudgeServer:
    """A real OpenAI-compatible chat-completions server on 127.0.0.1, with a scripted reply or status."""

    def __init__(self):
        self.requests = []
        self.reply = "Score: 7"
        self.status = 200
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append({"path": self.path, "auth": self.headers.get("Authorization"), "body": body})
                if server.status != 200:
                    self.send_error(server.status, "judge unavailable")
                    return
                payload = json.dumps(
                    {"choices": [{"message": {"role": "assistant", "content": server.reply}}]}
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def judge_server(monkeypatch):
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    server = JudgeServer()
    yield server
    server.close()


def test_judge_scores_through_the_chat_completions_protocol(judge_server, monkeypatch):
    monkeypatch.setenv("JUDGE_TEST_KEY", "sk-test")
    env = LLMJudgeEnvironment(
        judge_server.base_url,
        "judge-model",
        api_key_env="JUDGE_TEST_KEY",
        prompt_template="Q: {prompt}\nA: {completion}\nRef: {answer}\nScore {low}-{high}.",
    )
    reward = as_reward_function(env)
    assert reward.__name__ == "llm_judge_environment"
    scores = reward(
        prompts=[[{"role": "user", "content": "2+2?"}]] * 2, completions=["4", conversation("four")], answer=["4", "4"]
    )
    assert scores == [0.7, 0.7]
    assert len(judge_server.requests) == 2
    request = judge_server.requests[0]
    assert request["path"] == "/v1/chat/completions" and request["auth"] == "Bearer sk-test"
    assert request["body"]["model"] == "judge-model"
    contents = sorted(r["body"]["messages"][-1]["content"] for r in judge_server.requests)
    assert contents == ["Q: user: 2+2?\nA: 4\nRef: 4\nScore 0-10.", "Q: user: 2+2?\nA: four\nRef: 4\nScore 0-10."]


@pytest.mark.parametrize("reply", ["Score: 42", "Score: -1", "I cannot grade this."])
def test_judge_out_of_range_or_unparseable_reply_scores_the_failure_score(judge_server, reply, caplog):
    judge_server.reply = reply
    env = LLMJudgeEnvironment(judge_server.base_url, "judge-model", failure_score=-1.0)
    with caplog.at_level(logging.WARNING, logger="grpo_flow.environments"):
        assert as_reward_function(env)(prompts=["q"], completions=["a"]) == [-1.0]
    assert "llm judge" in caplog.text


def test_judge_server_error_scores_the_failure_score(judge_server, caplog):
    judge_server.status = 500
    env = LLMJudgeEnvironment(judge_server.base_url, "judge-model", failure_score=0.0, timeout_s=5.0)
    with caplog.at_level(logging.WARNING, logger="grpo_flow.environments"):
        assert as_reward_function(env)(prompts=["q", "q"], completions=["a", "b"]) == [0.0, 0.0]
    assert "500" in caplog.text and len(judge_server.requests) == 2


def test_judge_score_parsing_and_range():
    assert parse_judge_score("Reasoning... 3 points off.\nScore: 8.5") == 8.5
    assert parse_judge_score("I give it 6 out of 10") == 6.0
    assert parse_judge_score("no number") is None
    env = LLMJudgeEnvironment("http://unused", "m", score_range=(1, 5))
    assert env.normalise("Score: 5") == 1.0 and env.normalise("Score: 1") == 0.0 and env.normalise("score=3") == 0.5
    with pytest.raises(ValueError):
        LLMJudgeEnvironment("http://unused", "m", score_range=(5, 5))


def test_judge_without_its_api_key_is_a_configuration_error(judge_server, monkeypatch):
    monkeypatch.delenv("JUDGE_MISSING_KEY", raising=False)
    env = LLMJudgeEnvironment(judge_server.base_url, "m", api_key_env="JUDGE_MISSING_KEY")
    with pytest.raises(RuntimeError, match="JUDGE_MISSING_KEY"):
        as_reward_function(env)(prompts=["q"], completions=["a"])
    assert judge_server.requests == []

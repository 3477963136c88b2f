"""Reward environments: scoring logic as objects, handed to training as TRL reward functions.

A `RewardEnvironment` scores one completion (`score`) or a batch (`score_batch`); either may be
`async def`. It may run code through `self.sandbox`, any `CodeExecutor` (a `LocalSandbox` by
default; a remote backend only needs the same `run` / `run_batch`). `as_reward_function(env)`
turns it into a plain function with TRL's reward signature, `f(prompts, completions,
completion_ids=None, **columns) -> list[float | None]`, so it goes wherever a reward function
goes (`grpo_flow.workers.rewards.functions.score_batch`, `trl.GRPOTrainer(reward_funcs=...)`).

Built in:
- `MathAnswerEnvironment`: the answer in `\\boxed{...}` (or after `####`) checked against the
  gold column with `math_verify` (1/2, 0.5 and \\frac{1}{2} are the same answer).
- `CodeTestsEnvironment`: the completion's code run in the sandbox with MBPP-style asserts.
- `LLMJudgeEnvironment`: a score from an OpenAI-compatible chat-completions endpoint.
- `think_answer_format`, `answer_tag_format`: format rewards with TRL's signature.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import os
import re
import secrets
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import httpx

from grpo_flow.workers.rewards.deadline import run_coroutine
from grpo_flow.workers.rewards.sandbox import LocalSandbox, SandboxResult

logger = logging.getLogger("grpo_flow.environments")

Score = float | None
RewardFunc = Callable[..., list[Score]]


@runtime_checkable
class CodeExecutor(Protocol):
    """Runs programs in isolation: `LocalSandbox`, or a remote backend with the same two methods."""

    def run(
        self, code: str, *, stdin: str = "", timeout_s: float | None = None, files: Mapping[str, str] | None = None
    ) -> SandboxResult: ...

    def run_batch(
        self,
        codes: Sequence[str],
        *,
        stdins: Sequence[str] | None = None,
        timeout_s: float | None = None,
        files: Mapping[str, str] | None = None,
    ) -> list[SandboxResult]: ...


_default_sandbox: LocalSandbox | None = None
_default_sandbox_lock = threading.Lock()


def default_sandbox() -> LocalSandbox:
    """One `LocalSandbox` shared by every environment that is given none."""
    global _default_sandbox
    with _default_sandbox_lock:
        if _default_sandbox is None:
            _default_sandbox = LocalSandbox()
        return _default_sandbox


# --------------------------------------------------------------------------- the base class


def completion_text(completion: Any) -> str:
    """A completion as text: a string as is, a conversation as its last message's content."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Sequence) and completion and isinstance(completion[-1], Mapping):
        content = completion[-1].get("content", "")
        return content if isinstance(content, str) else str(content)
    raise TypeError(f"a completion must be a string or a list of message dicts, got {type(completion).__name__}")


def _is_per_sample(value: Any, n: int) -> bool:
    return isinstance(value, (list, tuple)) and len(value) == n


def sample_columns(columns: Mapping[str, Any], index: int, n: int) -> dict[str, Any]:
    """Sample `index`'s value of each per-sample column (a list of length n); other values as they are.

    TRL also passes values that are not columns (`trainer_state`, `log_metric`): they reach
    every sample unchanged.
    """
    return {name: value[index] if _is_per_sample(value, n) else value for name, value in columns.items()}


class RewardEnvironment:
    """Scores completions. Subclasses implement `score` and/or `score_batch`, sync or `async def`.

    `score(completion, prompt, **columns)` gets one completion (text), its prompt and that
    sample's columns; `score_batch(completions, prompts, **columns)` gets whole columns. A score
    is a float, or None where the environment does not apply to the sample. `failure_score` is
    what a sample gets when scoring it fails (a crash, a timeout, an unusable judge reply).
    """

    failure_score: float = 0.0

    def __init__(self, *, sandbox: CodeExecutor | None = None, failure_score: float | None = None) -> None:
        self._sandbox = sandbox
        if failure_score is not None:
            self.failure_score = failure_score

    @property
    def sandbox(self) -> CodeExecutor:
        sandbox = getattr(self, "_sandbox", None)
        if sandbox is None:  # also for subclasses that skip __init__
            sandbox = self._sandbox = default_sandbox()
        return sandbox

    @sandbox.setter
    def sandbox(self, executor: CodeExecutor) -> None:
        self._sandbox = executor

    def score(self, completion: str, prompt: Any, **columns: Any) -> Score | Awaitable[Score]:
        raise NotImplementedError(f"{type(self).__name__} implements neither score nor score_batch")

    def score_batch(
        self, completions: Sequence[str], prompts: Sequence[Any], **columns: Any
    ) -> list[Score] | Awaitable[list[Score]]:
        """`score` per sample; when `score` is async, an awaitable that runs them concurrently."""
        return score_each(self.score, completions, prompts, columns)

    def execute_in_sandbox(self, code: str, **kwargs: Any) -> SandboxResult:
        return self.sandbox.run(code, **kwargs)

    def execute_batch_in_sandbox(self, codes: Sequence[str], **kwargs: Any) -> list[SandboxResult]:
        return self.sandbox.run_batch(codes, **kwargs)


def score_each(
    score: Callable[..., Any], completions: Sequence[str], prompts: Sequence[Any], columns: Mapping[str, Any]
) -> list[Score] | Awaitable[list[Score]]:
    """Call `score` on every sample: a list, or (for an async `score`) an awaitable gathering them."""
    n = len(completions)
    calls = [(completions[i], prompts[i], sample_columns(columns, i, n)) for i in range(n)]
    if inspect.iscoroutinefunction(score):

        async def gather() -> list[Score]:
            return list(await asyncio.gather(*(score(c, p, **cols) for c, p, cols in calls)))

        return gather()
    return [score(c, p, **cols) for c, p, cols in calls]


def is_reward_environment(obj: Any) -> bool:
    """A `RewardEnvironment`, or any object (not a class) with a callable `score` or `score_batch`."""
    if isinstance(obj, RewardEnvironment):
        return True
    if isinstance(obj, type) or inspect.isroutine(obj):
        return False
    return callable(getattr(obj, "score_batch", None)) or callable(getattr(obj, "score", None))


def snake_case(name: str) -> str:
    """`MathAnswerEnvironment` -> `math_answer_environment`, `LLMJudge` -> `llm_judge`."""
    name = re.sub(r"(?<=[A-Z])(?=[A-Z][a-z])|(?<=[a-z0-9])(?=[A-Z])", "_", name)
    return name.lower()


def as_reward_function(env: Any, name: str | None = None) -> RewardFunc:
    """`env` as a sync function with TRL's reward signature, named `name` or after its class."""
    if not is_reward_environment(env):
        raise TypeError(f"{env!r} is not a reward environment (it has no score or score_batch method)")
    batch = getattr(env, "score_batch", None)
    score_batch = batch if callable(batch) else (lambda c, p, **cols: score_each(env.score, c, p, cols))

    def checked(scores: Any, count: int) -> list[Score]:
        scores = list(scores)
        if len(scores) != count:
            raise ValueError(f"{reward.__name__}: {len(scores)} scores for {count} completions")
        return [None if s is None else float(s) for s in scores]

    def scores_or_awaitable(
        prompts: Sequence[Any], completions: Sequence[Any], completion_ids: Any = None, **kwargs: Any
    ) -> list[Score] | Awaitable[list[Score]]:
        texts = [completion_text(c) for c in completions]
        if completion_ids is not None:
            kwargs["completion_ids"] = completion_ids
        scores = score_batch(texts, list(prompts), **kwargs)
        if inspect.isawaitable(scores):
            pending = scores

            async def finish() -> list[Score]:
                return checked(await pending, len(texts))

            return finish()
        return checked(scores, len(texts))

    def reward(
        prompts: Sequence[Any], completions: Sequence[Any], completion_ids: Any = None, **kwargs: Any
    ) -> list[Score]:
        scores = scores_or_awaitable(prompts, completions, completion_ids, **kwargs)
        return run_coroutine(scores) if inspect.isawaitable(scores) else scores

    reward.__name__ = reward.__qualname__ = name or snake_case(type(env).__name__)
    reward.environment = env  # type: ignore[attr-defined]
    return reward


# --------------------------------------------------------------------------- math answers

_HASHES = re.compile(r"####\s*(.+)")


def extract_math_answer(text: str) -> str | None:
    """The last `\\boxed{...}` content, else what follows the last `####` (its first line), else None."""
    from grpo_flow.workers.data.loaders import last_boxed  # the repo's balanced-brace reader of \boxed / \fbox

    boxed = last_boxed(text)
    if boxed:
        return boxed
    found = _HASHES.findall(text)
    if not found:
        return None
    return found[-1].strip() or None


class MathAnswerEnvironment(RewardEnvironment):
    """1.0 when the completion's final answer is mathematically equal to the gold answer, else 0.0.

    Both sides go through `math_verify.parse` (as LaTeX, falling back to plain text) and
    `math_verify.verify`. A sample without a gold answer gets None; a completion without a
    boxed or `####` answer gets 0.0.
    """

    def __init__(self, answer_column: str = "answer", *, failure_score: float | None = None) -> None:
        super().__init__(failure_score=failure_score)
        self.answer_column = answer_column

    def score(self, completion: str, prompt: Any, **columns: Any) -> Score:
        gold = columns.get(self.answer_column)
        if gold is None or str(gold).strip() == "":
            return None
        predicted = extract_math_answer(completion)
        if predicted is None:
            return 0.0
        try:
            return 1.0 if math_equal(str(gold), predicted) else 0.0
        except Exception as error:  # sympy can fail on odd input: the sample, not the run, fails
            logger.warning("math_answer: cannot compare %r with %r: %s", predicted, gold, error)
            return self.failure_score


def _parse_math(text: str) -> list[Any]:
    from math_verify import parse

    # math_verify's timeouts use SIGALRM, which only the main thread may set.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    text = text.strip()
    parsed = parse(f"${text.strip('$')}$", parsing_timeout=timeout)
    return parsed if parsed else parse(text, parsing_timeout=timeout)


def math_equal(gold: str, predicted: str) -> bool:
    """Whether two answers (LaTeX or plain: `\\frac{1}{2}`, `1/2`, `0.5`) are the same value."""
    from math_verify import verify

    gold_parsed, predicted_parsed = _parse_math(gold), _parse_math(predicted)
    if not gold_parsed or not predicted_parsed:
        return False
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    return bool(verify(gold_parsed, predicted_parsed, timeout_seconds=timeout))


# --------------------------------------------------------------------------- code with tests

_FENCED = re.compile(r"```[ \t]*(?:python3?|py)[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
_OPEN_FENCE = re.compile(r"```[ \t]*(?:python3?|py)[ \t]*\n(.*)$", re.DOTALL | re.IGNORECASE)


def extract_code(text: str) -> str:
    """The last ```python block (an unclosed last one counts: generation may stop inside it), else the text."""
    blocks = _FENCED.findall(text)
    if blocks:
        return blocks[-1]
    unclosed = _OPEN_FENCE.search(text)
    return unclosed.group(1) if unclosed else text


_TEST_HARNESS = """

def __grpo_run_tests(tests, marker):
    for index, test in enumerate(tests):
        try:
            exec(compile(test, "<test %d>" % index, "exec"), globals())
        except Exception as error:
            print("%s FAIL %d %s" % (marker, index, type(error).__name__), flush=True)
        else:
            print("%s PASS %d" % (marker, index), flush=True)


__grpo_run_tests({tests!r}, {marker!r})
"""


class CodeTestsEnvironment(RewardEnvironment):
    """Runs the completion's code with the sample's assert tests (MBPP's `test_list`) in the sandbox.

    The program is the setup code (`test_setup_code`, when the sample has one), the extracted
    code, then each test in turn, each in its own try block, reporting with a random marker
    (so that what the code prints cannot be read as a result). Score: 1.0 when every test
    passes, else 0.0; with `partial_credit=True`, the fraction that passed. A program that
    crashes before the tests run (a syntax error, an exception at import), is killed by a
    signal or runs out of time scores `failure_score`. A sample without tests gets None.

    The tests run in the same process as the code, as in MBPP's own evaluation: code written
    to cheat (reading main.py for the marker) can fake passes; the sandbox keeps it from
    doing anything else.
    """

    def __init__(
        self,
        tests_column: str = "test_list",
        setup_column: str = "test_setup_code",
        *,
        partial_credit: bool = False,
        timeout_s: float = 5.0,
        failure_score: float | None = None,
        sandbox: CodeExecutor | None = None,
    ) -> None:
        super().__init__(sandbox=sandbox, failure_score=failure_score)
        self.tests_column = tests_column
        self.setup_column = setup_column
        self.partial_credit = partial_credit
        self.timeout_s = timeout_s

    def build_program(self, completion: str, tests: Sequence[str], setup: str | None, marker: str) -> str:
        parts = [setup or "", extract_code(completion), _TEST_HARNESS.format(tests=list(tests), marker=marker)]
        return "\n".join(parts)

    def score_batch(self, completions: Sequence[str], prompts: Sequence[Any], **columns: Any) -> list[Score]:
        n = len(completions)
        tests_per_sample = [list(sample_columns(columns, i, n).get(self.tests_column) or []) for i in range(n)]
        setups = [sample_columns(columns, i, n).get(self.setup_column) for i in range(n)]
        runnable = [i for i in range(n) if tests_per_sample[i]]
        markers = {i: f"@@grpo-test-{secrets.token_hex(8)}" for i in runnable}
        programs = [self.build_program(completions[i], tests_per_sample[i], setups[i], markers[i]) for i in runnable]
        results = self.execute_batch_in_sandbox(programs, timeout_s=self.timeout_s) if programs else []
        scores: list[Score] = [None] * n
        for i, result in zip(runnable, results, strict=True):
            scores[i] = self.score_result(result, len(tests_per_sample[i]), markers[i])
        return scores

    def score(self, completion: str, prompt: Any, **columns: Any) -> Score:
        return self.score_batch([completion], [prompt], **{k: [v] for k, v in columns.items()})[0]

    def score_result(self, result: SandboxResult, n_tests: int, marker: str) -> float:
        if result.timed_out or result.signal is not None or result.exit_code != 0:
            return self.failure_score
        passed = set()
        for line in result.stdout.splitlines():
            fields = line.split()
            if len(fields) >= 3 and fields[0] == marker and fields[1] == "PASS" and fields[2].isdigit():
                passed.add(int(fields[2]))
        count = len(passed & set(range(n_tests)))
        if self.partial_credit:
            return count / n_tests
        return 1.0 if count == n_tests else 0.0


# --------------------------------------------------------------------------- format rewards

_THINK_ANSWER = re.compile(
    r"<think>(?:(?!</?think>).)*</think>\s*<answer>(?:(?!</?answer>|</?think>).)*</answer>", re.DOTALL
)
_ANSWER_TAG = re.compile(r"<answer>.*?</answer>", re.DOTALL)


def think_answer_format(completions: Sequence[Any], **kwargs: Any) -> list[float]:
    """1.0 when the completion is exactly `<think>...</think>` then `<answer>...</answer>` (outer whitespace aside)."""
    return [1.0 if _THINK_ANSWER.fullmatch(completion_text(c).strip()) else 0.0 for c in completions]


def answer_tag_format(completions: Sequence[Any], **kwargs: Any) -> list[float]:
    """1.0 when the completion holds an `<answer>...</answer>` pair."""
    return [1.0 if _ANSWER_TAG.search(completion_text(c)) else 0.0 for c in completions]


# --------------------------------------------------------------------------- LLM judge

DEFAULT_JUDGE_TEMPLATE = (
    "You are grading an answer to a question.\n\n"
    "Question:\n{prompt}\n\n"
    "Answer:\n{completion}\n\n"
    "Rate the answer's correctness and quality from {low} to {high}. "
    "Reply with one line of the form 'Score: N'."
)

_SCORE_LINE = re.compile(r"score\s*[:=]\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def parse_judge_score(reply: str) -> float | None:
    """The number after `Score:` in the reply, else its first number, else None."""
    found = _SCORE_LINE.search(reply) or _NUMBER.search(reply)
    return float(found.group(1) if found.re is _SCORE_LINE else found.group(0)) if found else None


def prompt_text(prompt: Any) -> str:
    """A prompt as text: a conversation becomes `role: content` lines."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Sequence):
        return "\n".join(f"{m.get('role', 'user')}: {m.get('content', '')}" for m in prompt if isinstance(m, Mapping))
    return str(prompt)


class _FormatFields(dict):
    """Template fields; an unknown `{name}` stays as written instead of failing."""

    def __missing__(self, key: str) -> str:
        return "{" + key + "}"


class LLMJudgeEnvironment(RewardEnvironment):
    """A score from a judge model behind an OpenAI-compatible `POST {base_url}/chat/completions`.

    The template is filled with `prompt`, `completion`, `low`, `high` and the sample's columns;
    the reply's `Score: N` (or first number) must lie in `score_range` and is mapped to [0, 1].
    An HTTP error, a timeout, an unparseable or out-of-range reply scores `failure_score` with a
    logged warning. The API key, when needed, is read from the environment variable
    `api_key_env` at request time (never stored).
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key_env: str | None = None,
        prompt_template: str = DEFAULT_JUDGE_TEMPLATE,
        score_range: tuple[float, float] = (0, 10),
        timeout_s: float = 60.0,
        max_concurrency: int = 8,
        temperature: float = 0.0,
        max_tokens: int | None = 256,
        failure_score: float | None = None,
    ) -> None:
        super().__init__(failure_score=failure_score)
        low, high = score_range
        if not high > low:
            raise ValueError(f"score_range must be (low, high) with high > low, got {score_range!r}")
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self.api_key_env = api_key_env
        self.prompt_template = prompt_template
        self.score_range = (float(low), float(high))
        self.timeout_s = timeout_s
        self.max_concurrency = max_concurrency
        self.temperature = temperature
        self.max_tokens = max_tokens

    def _headers(self) -> dict[str, str]:
        if self.api_key_env is None:
            return {}
        key = os.environ.get(self.api_key_env)
        if not key:
            raise RuntimeError(f"the judge's API key variable {self.api_key_env} is not set")
        return {"Authorization": f"Bearer {key}"}

    def render(self, completion: str, prompt: Any, columns: Mapping[str, Any]) -> str:
        low, high = self.score_range
        fields = _FormatFields({k: v for k, v in columns.items() if isinstance(v, (str, int, float))})
        fields.update(prompt=prompt_text(prompt), completion=completion, low=f"{low:g}", high=f"{high:g}")
        return self.prompt_template.format_map(fields)

    def request_body(self, content: str) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": "user", "content": content}],
            "temperature": self.temperature,
        }
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        return body

    def normalise(self, reply: str) -> float:
        value = parse_judge_score(reply)
        low, high = self.score_range
        if value is None or not math.isfinite(value):
            logger.warning("llm judge: no score in reply %r; scoring %s", reply[:200], self.failure_score)
            return self.failure_score
        if not low <= value <= high:
            logger.warning("llm judge: score %g outside [%g, %g]; scoring %s", value, low, high, self.failure_score)
            return self.failure_score
        return (value - low) / (high - low)

    async def _judge(
        self, client: httpx.AsyncClient, limit: asyncio.Semaphore, content: str, headers: dict[str, str]
    ) -> float:
        async with limit:
            try:
                response = await client.post(self.url, json=self.request_body(content), headers=headers)
                response.raise_for_status()
                reply = response.json()["choices"][0]["message"]["content"]
            except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as error:
                logger.warning("llm judge: request to %s failed (%s); scoring %s", self.url, error, self.failure_score)
                return self.failure_score
        return self.normalise(reply if isinstance(reply, str) else str(reply))

    async def score_batch(self, completions: Sequence[str], prompts: Sequence[Any], **columns: Any) -> list[Score]:
        n = len(completions)
        headers = self._headers()
        contents = [self.render(completions[i], prompts[i], sample_columns(columns, i, n)) for i in range(n)]
        limit = asyncio.Semaphore(self.max_concurrency)
        async with httpx.AsyncClient(timeout=self.timeout_s) as client:
            return list(await asyncio.gather(*(self._judge(client, limit, c, headers) for c in contents)))

    async def score(self, completion: str, prompt: Any, **columns: Any) -> Score:
        return (await self.score_batch([completion], [prompt], **{k: [v] for k, v in columns.items()}))[0]

"""Small local stand-ins for the hub data sets `grpo_flow.workers.data.loaders` loads, in the hub's exact format.

The Hugging Face hub is not reachable in tests, so these functions build, by code, a
handful of rows per split with the hub's split names, column names and column types
(checked against the data set cards): openai/gsm8k `main`, DigitalLearningGmbH/MATH-lighteval,
HuggingFaceH4/MATH-500 and google-research-datasets/mbpp `full`. The content is written in
each set's style (GSM8K's `<<calc>>` annotations and `#### 1,234` answers with commas,
MATH's nested braces inside `\\boxed{...}`, `\\fbox`, `\\boxed 5` and `Level ?`, MBPP's
`\\r\\n` code and setup code), so the builders meet the cases the real sets hold.

`FixtureHub()` is a drop-in for `datasets.load_dataset(path, name=...)` that serves them
and records every call, so tests can check the hub ids and configs the builders ask for.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from datasets import Dataset, DatasetDict, Features, List, Value

# ----------------------------------------------------------------------------- openai/gsm8k, config "main"

GSM8K_FEATURES = Features({"question": Value("string"), "answer": Value("string")})

GSM8K_TRAIN = [
    (
        "A bakery sells muffins for $3 each. On Monday it sold 1,250 muffins and on Tuesday it sold "
        "1,430 muffins. How much money, in dollars, did the bakery make over the two days?",
        "Over the two days the bakery sold 1,250 + 1,430 = <<1250+1430=2680>>2680 muffins.\n"
        "It made 2680 * 3 = <<2680*3=8040>>8040 dollars.\n#### 8,040",
    ),
    (
        "Maria reads 12 pages a day. Her book has 180 pages. How many days will it take her to finish the book?",
        "It will take her 180 / 12 = <<180/12=15>>15 days.\n#### 15",
    ),
    (
        "A school has 3 buses. Each bus carries 42 students, and 17 students walk to school. "
        "How many students go to the school?",
        "The buses carry 3 * 42 = <<3*42=126>>126 students.\n"
        "With the walkers there are 126 + 17 = <<126+17=143>>143 students.\n#### 143",
    ),
]
GSM8K_TEST = [
    (
        "A city library had 12,400 books. It bought 3,650 new books and gave away 1,050 old ones. "
        "How many books does the library have now?",
        "After buying, it had 12,400 + 3,650 = <<12400+3650=16050>>16,050 books.\n"
        "After giving some away, it had 16,050 - 1,050 = <<16050-1050=15000>>15,000 books.\n#### 15,000",
    ),
    (
        "Tom buys 4 notebooks at $2 each and a pen for $3. How much does he spend in all?",
        "The notebooks cost 4 * 2 = <<4*2=8>>8 dollars.\nIn all he spends 8 + 3 = <<8+3=11>>11 dollars.\n#### 11",
    ),
]
# The answers `workers.data.loaders` must extract: no commas.
GSM8K_ANSWERS = {"train": ["8040", "15", "143"], "test": ["15000", "11"]}


def gsm8k_hub() -> DatasetDict:
    """openai/gsm8k `main`: splits train and test, columns question and answer."""
    return DatasetDict(
        {
            split: Dataset.from_dict(
                {"question": [q for q, _ in rows], "answer": [a for _, a in rows]}, features=GSM8K_FEATURES
            )
            for split, rows in (("train", GSM8K_TRAIN), ("test", GSM8K_TEST))
        }
    )


# ----------------------------------------------------------------------------- DigitalLearningGmbH/MATH-lighteval

MATH_FEATURES = Features(
    {
        "problem": Value("string"),
        "level": Value("string"),
        "solution": Value("string"),
        "type": Value("string"),
    }
)

# (problem, level, solution, type, the answer `last_boxed` must find)
MATH_TRAIN = [
    (
        "What is the value of $\\sqrt{36 \\times \\sqrt{16}}$?",
        "Level 2",
        "Calculating from the inside out, $$\\sqrt{36 \\times \\sqrt{16}} = \\sqrt{36 \\times 4} = "
        "\\sqrt{144} = \\boxed{12}.$$",
        "Algebra",
        "12",
    ),
    (
        "Solve for $x$: $\\frac{x}{x+1} = \\frac{1}{3}$.",
        "Level 3",
        "Cross-multiplying gives $3x = x + 1$, so $2x = 1$ and $x = \\boxed{\\frac{1}{2}}$.",
        "Intermediate Algebra",
        "\\frac{1}{2}",
    ),
    (
        "Convert the point $(0,-5)$ in rectangular coordinates to polar coordinates.  Enter your answer "
        "in the form $(r,\\theta),$ where $r > 0$ and $0 \\le \\theta < 2 \\pi.$",
        "Level 2",
        "We have that $r = \\sqrt{0^2 + (-5)^2} = 5.$  The point lies on the negative $y$-axis, so "
        "$\\theta = \\frac{3 \\pi}{2}.$\n\nTherefore, the polar coordinates are "
        "$\\boxed{\\left( 5, \\frac{3 \\pi}{2} \\right)}.$",
        "Precalculus",
        "\\left( 5, \\frac{3 \\pi}{2} \\right)",
    ),
    (
        "In an equilateral triangle, what is the measure, in degrees, of each interior angle?",
        "Level ?",
        "The three angles are equal and sum to $180^\\circ$, so each one measures $\\fbox{60}$ degrees.",
        "Geometry",
        "60",
    ),
    (
        "What is the remainder when $2^{10}$ is divided by $7$?",
        "Level 1",
        "Since $2^3 = 8 \\equiv 1 \\pmod{7}$, we have $2^{10} = (2^3)^3 \\cdot 2 \\equiv 2 \\pmod{7}$, "
        "so the remainder is $\\boxed 2$.",
        "Number Theory",
        "2",
    ),
    (
        "For what values of $x$ is $x^2 + x - 2 \\ge 0$? Express your answer in interval notation.",
        "Level 5",
        "The quadratic factors as $(x+2)(x-1) \\ge 0$, which holds outside the roots: "
        "$x \\in \\boxed{(-\\infty, -2] \\cup [1, \\infty)}$.",
        "Algebra",
        "(-\\infty, -2] \\cup [1, \\infty)",
    ),
]
MATH_TEST = [
    (
        "Simplify $\\frac{84}{144}$.",
        "Level 2",
        "Both 84 and 144 are divisible by 12, so $\\frac{84}{144} = \\boxed{\\frac{7}{12}}$.",
        "Prealgebra",
        "\\frac{7}{12}",
    ),
    (
        "If $f(x) = 3x + 2$ and $g(x) = x^2 - 1$, what is $f(g(2))$?",
        "Level 3",
        "First $g(2) = 2^2 - 1 = 3$, then $f(3) = 3 \\cdot 3 + 2 = \\boxed{11}$.",
        "Algebra",
        "11",
    ),
    (
        "Find all real solutions of $x^2 - 5x + 6 = 0$. Enter all the solutions, separated by commas.",
        "Level 4",
        "The quadratic factors as $(x-2)(x-3) = 0$, so the solutions are $\\boxed{2, 3}$.",
        "Intermediate Algebra",
        "2, 3",
    ),
    (
        "Compute $\\begin{pmatrix} 2 & 0 \\\\ 1 & 3 \\end{pmatrix} \\begin{pmatrix} 1 \\\\ -1 \\end{pmatrix}$.",
        "Level 3",
        "We have that\n\\[\\begin{pmatrix} 2 & 0 \\\\ 1 & 3 \\end{pmatrix} \\begin{pmatrix} 1 \\\\ -1 \\end{pmatrix} "
        "= \\boxed{\\begin{pmatrix} 2 \\\\ -2 \\end{pmatrix}}.\\]",
        "Precalculus",
        "\\begin{pmatrix} 2 \\\\ -2 \\end{pmatrix}",
    ),
    (
        "What is the solution set of $|x| = -1$? Give your answer as a set.",
        "Level 1",
        "An absolute value is never negative, so the equation has no solution and the solution set "
        "is $\\boxed{\\emptyset}$.",
        "Algebra",
        "\\emptyset",
    ),
]
MATH_ANSWERS = {"train": [row[4] for row in MATH_TRAIN], "test": [row[4] for row in MATH_TEST]}
MATH_LEVELS = {"train": [2, 3, 2, None, 1, 5], "test": [2, 3, 4, 3, 1]}


def math_split(rows: list[tuple[str, str, str, str, str]]) -> Dataset:
    """MATH-lighteval rows (the expected-answer field is ours, not a hub column)."""
    return Dataset.from_dict(
        {
            "problem": [r[0] for r in rows],
            "level": [r[1] for r in rows],
            "solution": [r[2] for r in rows],
            "type": [r[3] for r in rows],
        },
        features=MATH_FEATURES,
    )


def math_hub() -> DatasetDict:
    """DigitalLearningGmbH/MATH-lighteval (`default`): splits train and test; problem, level, solution, type."""
    return DatasetDict({"train": math_split(MATH_TRAIN), "test": math_split(MATH_TEST)})


# ----------------------------------------------------------------------------- HuggingFaceH4/MATH-500

MATH500_FEATURES = Features(
    {
        "problem": Value("string"),
        "solution": Value("string"),
        "answer": Value("string"),
        "subject": Value("string"),
        "level": Value("int64"),
        "unique_id": Value("string"),
    }
)
# MATH-500 is drawn from the MATH test set: these are MATH_TEST rows 0, 1 and 3.
MATH500_ROWS = [
    (MATH_TEST[0], "test/prealgebra/1042.json"),
    (MATH_TEST[1], "test/algebra/2170.json"),
    (MATH_TEST[3], "test/precalculus/603.json"),
]
MATH500_ANSWERS = [row[4] for row, _ in MATH500_ROWS]


def math500_hub(extra_problems: tuple[str, ...] = ()) -> DatasetDict:
    """HuggingFaceH4/MATH-500: one split, `test`; problem, solution, answer, subject, level (int), unique_id.

    `extra_problems` appends rows with those problem texts (answer "0"), to test overlap
    with the training set.
    """
    rows = [
        {
            "problem": r[0],
            "solution": r[2],
            "answer": r[4],
            "subject": r[3],
            "level": int(r[1].split()[-1]),
            "unique_id": uid,
        }
        for r, uid in MATH500_ROWS
    ]
    rows += [
        {
            "problem": p,
            "solution": "So the answer is $\\boxed{0}$.",
            "answer": "0",
            "subject": "Algebra",
            "level": 1,
            "unique_id": f"test/algebra/{9000 + i}.json",
        }
        for i, p in enumerate(extra_problems)
    ]
    return DatasetDict({"test": Dataset.from_list(rows, features=MATH500_FEATURES)})


# ------------------------------------------------------------------------ google-research-datasets/mbpp, "full"

MBPP_FEATURES = Features(
    {
        "task_id": Value("int32"),
        "text": Value("string"),
        "code": Value("string"),
        "test_list": List(Value("string")),
        "test_setup_code": Value("string"),
        "challenge_test_list": List(Value("string")),
    }
)


def mbpp_row(
    task_id: int, text: str, code: str, tests: list[str], setup: str = "", challenge: list[str] | None = None
) -> dict[str, Any]:
    """One MBPP row; the hub's code uses Windows line ends, kept here."""
    return {
        "task_id": task_id,
        "text": text,
        "code": code.replace("\n", "\r\n"),
        "test_list": tests,
        "test_setup_code": setup,
        "challenge_test_list": challenge or [],
    }


# The hub's id ranges: prompt 1-10, test 11-510, validation 511-600, train 601-974.
MBPP_SPLITS: dict[str, list[dict[str, Any]]] = {
    "prompt": [
        mbpp_row(
            1,
            "Write a function to return the sum of all even numbers in a list.",
            "def sum_even(nums):\n    return sum(n for n in nums if n % 2 == 0)",
            ["assert sum_even([1, 2, 3, 4]) == 6", "assert sum_even([]) == 0", "assert sum_even([7, 9]) == 0"],
        ),
    ],
    "test": [
        mbpp_row(
            11,
            "Write a python function to count the vowels in a given string.",
            "def count_vowels(s):\n  return sum(1 for c in s.lower() if c in 'aeiou')",
            [
                "assert count_vowels('hello') == 2",
                "assert count_vowels('Python') == 1",
                "assert count_vowels('AEIOU') == 5",
            ],
        ),
        mbpp_row(
            12,
            "Write a function to find the area of a circle given its radius, rounded to two decimals.",
            "def circle_area(r):\n  return round(math.pi * r * r, 2)",
            ["assert circle_area(1) == 3.14", "assert circle_area(2) == 12.57", "assert circle_area(0) == 0"],
            setup="import math",
        ),
        mbpp_row(
            13,
            "Write a function to reverse the order of words in a given sentence.",
            "def reverse_words(s):\n  return ' '.join(reversed(s.split()))",
            [
                "assert reverse_words('python program') == 'program python'",
                "assert reverse_words('java language') == 'language java'",
                "assert reverse_words('indian man') == 'man indian'",
            ],
            challenge=["assert reverse_words('') == ''", "assert reverse_words('a  b') == 'b a'"],
        ),
    ],
    "validation": [
        mbpp_row(
            511,
            "Write a function to check whether the given number is a perfect square or not.",
            "def is_perfect_square(n):\n  i = 0\n  while i * i < n:\n    i += 1\n  return i * i == n",
            [
                "assert is_perfect_square(10) == False",
                "assert is_perfect_square(36) == True",
                "assert is_perfect_square(14) == False",
            ],
        ),
    ],
    "train": [
        mbpp_row(
            601,
            "Write a function to find the maximum of three numbers.",
            "def max_of_three(a, b, c):\n  return max(a, b, c)",
            [
                "assert max_of_three(10, 20, 30) == 30",
                "assert max_of_three(55, 47, 39) == 55",
                "assert max_of_three(10, 49, 30) == 49",
            ],
        ),
        mbpp_row(
            602,
            "Write a python function to check whether the given string is a palindrome or not.",
            "def is_palindrome(s):\n  return s == s[::-1]",
            [
                "assert is_palindrome('madam') == True",
                "assert is_palindrome('python') == False",
                "assert is_palindrome('') == True",
            ],
        ),
        mbpp_row(
            603,
            "Write a function to flatten a given nested list structure.",
            "def flatten_list(items):\n  out = []\n  for x in items:\n    if isinstance(x, list):\n"
            "      out.extend(flatten_list(x))\n    else:\n      out.append(x)\n  return out",
            [
                "assert flatten_list([0, 10, [20, 30], 40]) == [0, 10, 20, 30, 40]",
                "assert flatten_list([[1, [2]], 3]) == [1, 2, 3]",
                "assert flatten_list([]) == []",
            ],
        ),
    ],
}


def mbpp_hub() -> DatasetDict:
    """google-research-datasets/mbpp `full`: splits train, test, validation, prompt."""
    return DatasetDict(
        {
            split: Dataset.from_list(MBPP_SPLITS[split], features=MBPP_FEATURES)
            for split in ("train", "test", "validation", "prompt")
        }
    )


# ----------------------------------------------------------------------------- the loader

# (hub id, config) -> builder; None stands for "no config given" (the set's default).
HUB_FIXTURES: dict[tuple[str, str | None], Callable[[], DatasetDict]] = {
    ("openai/gsm8k", "main"): gsm8k_hub,
    ("DigitalLearningGmbH/MATH-lighteval", "default"): math_hub,
    ("DigitalLearningGmbH/MATH-lighteval", None): math_hub,
    ("HuggingFaceH4/MATH-500", "default"): math500_hub,
    ("HuggingFaceH4/MATH-500", None): math500_hub,
    ("google-research-datasets/mbpp", "full"): mbpp_hub,
}


class FixtureHub:
    """Serves the fixtures as `datasets.load_dataset(path, name=None, **kwargs)` would serve the hub.

    `overrides` replaces what a hub id returns (to feed a builder a changed or broken set);
    `calls` lists every (path, name) asked for. An id or config not here raises
    FileNotFoundError, as `datasets` does for a set that does not exist.
    """

    def __init__(self, overrides: dict[str, Callable[[], Any]] | None = None) -> None:
        self.overrides = overrides or {}
        self.calls: list[tuple[str, str | None]] = []

    def __call__(self, path: str, name: str | None = None, **kwargs: Any) -> Any:
        self.calls.append((path, name))
        if path in self.overrides:
            return self.overrides[path]()
        if (path, name) not in HUB_FIXTURES:
            raise FileNotFoundError(f"Dataset {path!r} (config {name!r}) doesn't exist in the hub fixtures")
        return HUB_FIXTURES[(path, name)]()

"""Right, wrong, partial, slow and crashing programs for each code data source, with the scores the
reference verl (0.9.1, its PRIME code checker with continuous=True: the default for these data
sources without a SandboxFusion URL) gives them. Checked against that scorer once by hand."""

from __future__ import annotations

import json

ADD = {"inputs": ["1 2\n", "5 0\n", "10 20\n"], "outputs": ["3\n", "5\n", "30\n"]}
# Twelve tests; the last one only is failed by OFF_AT_12: the score counts the first ten.
TWELVE = {
    "inputs": [f"{i}\n" for i in range(1, 13)],
    "outputs": [f"{i * i}\n" for i in range(1, 12)] + ["0\n"],
}
THIRD = {"inputs": ["3\n", "7\n"], "outputs": ["0.3333333\n", "0.1428571\n"]}
CALL = {"fn_name": "add_up", "inputs": ["1\n2", "[1]\n[2]", "-5\n5"], "outputs": ["3", "[[1, 2]]", "0"]}

SUM_RIGHT = "a, b = map(int, input().split())\nprint(a + b)\n"
SUM_MINUS = "a, b = map(int, input().split())\nprint(a - b)\n"  # right only when b == 0
SUM_CRASH = "a, b = map(int, input().split())\nprint(a // 0)\n"
SUM_CRASH_ON_10 = "a, b = map(int, input().split())\nif a == 10:\n    raise ValueError(a)\nprint(a + b)\n"
SUM_SLOW = "a, b = map(int, input().split())\nwhile True:\n    a += 1\n"
SUM_SPACED = "a, b = map(int, input().split())\nprint()\nprint(' ', a + b, '  ')\nprint()\n"
SUM_NO_IMPORT = (
    "a, b = map(int, stdin.readline().split())\nprint(int(fsum([a, b])))\n"  # names of the prelude
)
SUM_FENCED = "Here is my solution:\n```python\n" + SUM_RIGHT + "```\nIt adds the numbers."
SUM_SYNTAX = "```python\ndef f(:\n    pass\n```"

CASES = [
    # (data_source, response, ground truth, reference score)
    ("codecontests", SUM_RIGHT, ADD, 1.0),
    ("codecontests", SUM_FENCED, json.dumps(ADD), 1.0),
    ("codecontests", SUM_MINUS, ADD, 1 / 3),
    ("codecontests", SUM_SLOW, ADD, 0.0),
    ("codecontests", SUM_SYNTAX, ADD, 0.0),
    ("apps", SUM_RIGHT, json.dumps(ADD), 1.0),
    ("apps", SUM_CRASH, ADD, 0.0),
    ("apps", SUM_CRASH_ON_10, ADD, 2 / 3),
    ("apps", "import math\nn = int(input())\nprint(1 / n)\n", THIRD, 1.0),
    ("apps", "n = int(input())\nprint(round(1 / n, 2))\n", THIRD, 0.0),
    ("codeforces", SUM_SPACED, ADD, 1.0),
    ("codeforces", SUM_NO_IMPORT, ADD, 1.0),
    ("codeforces", "n = int(input())\nprint(n * n)\n", TWELVE, 1.0),
    ("codeforces", "n = int(input())\nprint(n * n if n < 6 else 0)\n", TWELVE, 0.5),
    ("taco", "def add_up(a, b):\n    return a + b\n", CALL, 1.0),
    ("taco", "class Solution:\n    def add_up(self, a, b):\n        return a + b\n", json.dumps(CALL), 1.0),
    # Right on one test of three: function-call tasks are all or nothing in the reference.
    ("taco", "def add_up(a, b):\n    return a - b if isinstance(a, int) else a + b\n", CALL, 0.0),
    ("apps", "def add_up(a, b):\n    raise RuntimeError('no')\n", CALL, 0.0),
    ("taco", "def add_up(a, b):\n    while True:\n        pass\n", CALL, 0.0),
    ("taco", "def plus(a, b):\n    return a + b\n", CALL, 0.0),
    (
        "taco",
        "def add_up(a, b):\n    return (a + b, )[0]\n",
        {**CALL, "outputs": ["[3]", "[[1, 2]]", "[0]"]},
        1.0,
    ),
]

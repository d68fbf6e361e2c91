"""Countdown: reach a target number from given numbers with + - * / (each number once).

Converts rows in the public schema (``nums``: list of ints, ``target``: int) or generates
solvable puzzles. ``reward_model.ground_truth`` is ``{"target": T, "numbers": [...]}``;
the model answers with an equation inside ``<answer> </answer>``.
"""

from __future__ import annotations

import random
from typing import Any

from verl.data.tasks.common import make_record, require

DATA_SOURCE = "countdown"


def prompt_text(numbers: list[int], target: int) -> str:
    """The task statement for one puzzle."""
    return (
        f"Using the numbers {numbers}, write an equation that equals {target}. You may use "
        f"+, -, * and / and each number at most once. Think it through, then give only the "
        f"equation inside <answer> </answer>, for example <answer>(1 + 2) * 3</answer>."
    )


def puzzle_record(numbers: list[int], target: int, *, split: str, index: int) -> dict[str, Any]:
    """The verl record of one puzzle."""
    return make_record(
        data_source=DATA_SOURCE,
        prompt=prompt_text(numbers, target),
        ground_truth={"target": int(target), "numbers": [int(n) for n in numbers]},
        extra_info={"split": split, "index": index},
    )


def convert_row(row: dict[str, Any], *, index: int, split: str, path: str) -> dict[str, Any]:
    """One row of the public schema (``nums``, ``target``) as a verl record."""
    numbers = require(row, "nums", path=path, index=index, kind=list)
    target = require(row, "target", path=path, index=index, kind=int)
    if not numbers or not all(isinstance(n, int) for n in numbers):
        raise ValueError(f"{path}: row {index} field 'nums' must be a non-empty list of integers")
    return puzzle_record(numbers, target, split=split, index=index)


def make_puzzle(rng: random.Random, *, count: int, max_number: int) -> tuple[list[int], int, str]:
    """A solvable puzzle: ``count`` numbers in [1, max_number], a target and one solution.

    The target is built by folding the shuffled numbers with random operators that keep
    every intermediate value a positive integer, so a solution always exists.
    """
    if count < 2 or max_number < 2:
        raise ValueError(f"need count >= 2 and max_number >= 2, got count={count}, max_number={max_number}")
    while True:
        numbers = [rng.randint(1, max_number) for _ in range(count)]
        order = numbers[:]
        rng.shuffle(order)
        value, expr = order[0], str(order[0])
        for n in order[1:]:
            choices = ["+", "*"]
            if value - n > 0:
                choices.append("-")
            if value % n == 0:
                choices.append("/")
            op = rng.choice(choices)
            value = {"+": value + n, "-": value - n, "*": value * n, "/": value // n}[op]
            expr = f"({expr} {op} {n})"
        if 1 <= value <= 1000:
            return numbers, value, expr


def generate(
    num: int, *, count: int = 4, max_number: int = 99, seed: int = 0, split: str = "train"
) -> list[dict[str, Any]]:
    """``num`` generated puzzle records; ``extra_info.solution`` holds one valid equation."""
    rng = random.Random(seed)
    records = []
    for i in range(num):
        numbers, target, solution = make_puzzle(rng, count=count, max_number=max_number)
        record = puzzle_record(numbers, target, split=split, index=i)
        record["extra_info"]["solution"] = solution
        records.append(record)
    return records

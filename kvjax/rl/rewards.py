"""Programmatic rewards: small arithmetic problems scored by parsing the completion.

The task is sized for a 135M instruct model: it answers "What is 7 + 5?" correctly a few times
in twenty at temperature 1, so a group of samples usually holds both better and worse answers
and group-relative advantages are not all zero.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

_INTEGER = re.compile(r"-?\d+")

# Reward tiers of `arithmetic_reward`.
CORRECT_FIRST = 1.0  # the first integer in the completion is the answer
CORRECT_LATER = 0.5  # the answer appears, after some other integer
ANY_INTEGER = 0.1  # an integer appears, but not the answer
NO_INTEGER = 0.0


@dataclasses.dataclass(frozen=True)
class ArithmeticProblem:
    """One question and its answer.

    Attributes:
      question: the user message, e.g. 'What is 7 + 5? Answer with a number.'.
      answer: the correct integer.
    """

    question: str
    answer: int


def arithmetic_problems(num_problems: int, *, seed: int, max_operand: int = 9
                        ) -> list[ArithmeticProblem]:
    """`num_problems` additions of two operands in [1, max_operand], reproducible from `seed`."""
    if not isinstance(num_problems, int) or num_problems <= 0:
        raise ValueError(f"num_problems must be a positive int, got {num_problems!r}")
    if not isinstance(max_operand, int) or max_operand < 1:
        raise ValueError(f"max_operand must be an int >= 1, got {max_operand!r}")
    rng = np.random.default_rng(seed)
    operands = rng.integers(1, max_operand + 1, size=(num_problems, 2))
    return [ArithmeticProblem(question=f"What is {a} + {b}? Answer with a number.",
                              answer=int(a + b)) for a, b in operands.tolist()]


def arithmetic_reward(completion: str, answer: int) -> float:
    """Scores a completion: CORRECT_FIRST, CORRECT_LATER, ANY_INTEGER or NO_INTEGER.

    With positive operands the answer is larger than either operand, so restating the question
    ("7 + 5 = 12") scores CORRECT_LATER, never CORRECT_FIRST by accident.
    """
    integers = [int(s) for s in _INTEGER.findall(completion)]
    if not integers:
        return NO_INTEGER
    if integers[0] == answer:
        return CORRECT_FIRST
    if answer in integers:
        return CORRECT_LATER
    return ANY_INTEGER

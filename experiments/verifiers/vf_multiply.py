"""A verifiers tool environment, the example of docs/environments.md: two-digit products with a
`multiply` tool; the rubric pays 1 when the last number of the final answer is the product.

    PYTHONPATH=experiments/verifiers python -m rlkit task=verifiers environment=verifiers task.env=vf_multiply
"""

import random
import re

import verifiers as vf
from datasets import Dataset


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


def questions(n: int, seed: int) -> Dataset:
    rng = random.Random(seed)
    pairs = [(rng.randint(10, 99), rng.randint(10, 99)) for _ in range(n)]
    return Dataset.from_list([{"question": f"What is {a} * {b}?", "answer": str(a * b)} for a, b in pairs])


def load_environment(n_train: int = 64, n_eval: int = 16, seed: int = 0, max_turns: int = 3) -> vf.Environment:
    parser = vf.Parser()

    def product(completion, answer, **kwargs) -> float:
        numbers = re.findall(r"-?\d+", parser.parse_answer(completion) or "")
        return float(bool(numbers) and numbers[-1] == answer)

    return vf.ToolEnv(
        dataset=questions(n_train, seed),
        eval_dataset=questions(n_eval, seed + 1),
        system_prompt="Answer the question. Use the multiply tool, then give the product.",
        tools=[multiply],
        rubric=vf.Rubric(funcs=[product], parser=parser),
        parser=parser,
        max_turns=max_turns,
    )

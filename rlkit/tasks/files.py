"""A task read from data files with `datasets.load_dataset` (JSON lines, CSV, Parquet, ...)."""

from __future__ import annotations

import math

from datasets import Value

from rlkit.tasks.base import Task, TaskError, load_table


def check_numbers(values: list, split: str) -> None:
    """Every `difficulty` of a split is a finite number (or the text of one); else the row is named."""
    for i, v in enumerate(values):
        try:
            ok = not isinstance(v, bool) and math.isfinite(float(v))
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise TaskError(f"task.{split} row {i} has difficulty {v!r}; the difficulty column must hold numbers")


class FileTask(Task):
    """Prompts and reference answers from local files (or a hub data set id when online), as the
    files spell them (a JSON or CSV number keeps its text: `007`, `1.50`); reward 1 when the
    completion, stripped, equals the answer. An optional `difficulty` column
    splits the metrics by its values."""

    def __init__(
        self,
        train_path: str,
        eval_path: str,
        format: str = "json",
        prompt_key: str = "prompt",
        answer_key: str = "answer",
    ):
        for name, path in (("train", train_path), ("eval", eval_path)):
            split = load_table(f"{name}_path", path, format, (prompt_key, answer_key), as_text=True)
            extra = ["difficulty"] if "difficulty" in split.column_names else []  # optional: metrics split by it
            split = split.select_columns([prompt_key, answer_key, *extra])
            if (prompt_key, answer_key) != ("prompt", "answer"):
                split = split.rename_columns({prompt_key: "prompt", answer_key: "answer"})
            for col in ("prompt", "answer"):  # numbers in a CSV or JSON file are text to the policy
                if split.features[col] != Value("string"):
                    split = split.cast_column(col, Value("string"))
            if extra:
                check_numbers(split["difficulty"], name)
                split = split.cast_column("difficulty", Value("float64"))
            setattr(self, name, split)

    def reward(self, row: dict, completion: str) -> float:
        return float(completion.strip() == str(row["answer"]).strip())

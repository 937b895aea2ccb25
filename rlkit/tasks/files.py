"""A task read from data files with `datasets.load_dataset` (JSON lines, CSV, Parquet, ...)."""
from __future__ import annotations

from datasets import Value, load_dataset

from rlkit.tasks.base import Task, TaskError


class FileTask(Task):
    """Prompts and reference answers from local files (or a hub data set id when online);
    reward 1 when the completion, stripped, equals the answer. An optional `difficulty` column
    splits the metrics by its values."""

    def __init__(self, train_path: str, eval_path: str, format: str = "json", prompt_key: str = "prompt",
                 answer_key: str = "answer"):
        for name, path in (("train", train_path), ("eval", eval_path)):
            try:
                split = load_dataset(format, data_files=path, split="train")
            except Exception as e:
                raise TaskError(f"task.{name}_path: cannot load {format} file {path!r}: {type(e).__name__}: {e}") from e
            for key, col in ((prompt_key, "prompt"), (answer_key, "answer")):
                if key not in split.column_names:
                    raise TaskError(f"task.{name} has no '{key}' column (columns: {split.column_names})")
            extra = ["difficulty"] if "difficulty" in split.column_names else []  # optional: metrics split by it
            split = split.select_columns([prompt_key, answer_key, *extra])
            if (prompt_key, answer_key) != ("prompt", "answer"):
                split = split.rename_columns({prompt_key: "prompt", answer_key: "answer"})
            for col in ("prompt", "answer"):  # numbers in a CSV or JSON file are text to the policy
                if split.features[col] != Value("string"):
                    split = split.cast_column(col, Value("string"))
            setattr(self, name, split)

    def reward(self, row: dict, completion: str) -> float:
        return float(completion.strip() == str(row["answer"]).strip())

"""Tasks read from data files: they load and train (text and numeric answers, the file's own text
kept), and bad files, rows, splits and difficulties are named before training."""

import json
from pathlib import Path

import pytest
import torch

from cli import run_cli
from conftest import make_cfg
from helpers import GOOD, file_task, write_jsonl
from rlkit.exits import EXIT_BAD_INPUT
from rlkit.metrics import by_difficulty
from rlkit.session import run
from rlkit.tasks.base import TaskError
from rlkit.tasks.files import FileTask


def write_csv(path: Path, text: str, bom: bool = False) -> str:
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + text.encode())
    return str(path)


def test_file_task_trains_from_files_it_loads(tmp_path, warm_cache):
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(5) for b in range(5)]
    summary = run(make_cfg(file_task(tmp_path, rows, rows[:4]), cache_dir=warm_cache), str(tmp_path / "run"))
    assert summary["steps"] == 2 and 0 <= summary["accuracy_after"] <= 1


@pytest.mark.parametrize("fmt", ["csv", "json"])
def test_file_task_with_numeric_answers_trains(tmp_path, fmt, warm_cache):
    rows = [{"prompt": f"{a}+{b}=", "answer": a + b} for a in range(5) for b in range(5)]  # answers are ints
    if fmt == "csv":
        for name in ("train", "eval"):
            (tmp_path / f"{name}.csv").write_text(
                "prompt,answer\n" + "".join(f"{r['prompt']},{r['answer']}\n" for r in rows)
            )
        files = [
            "task=files",
            "task.format=csv",
            f"task.train_path={tmp_path / 'train.csv'}",
            f"task.eval_path={tmp_path / 'eval.csv'}",
        ]
    else:
        files = file_task(tmp_path, rows, rows[:4])
    summary = run(make_cfg(files + ["steps=1"], cache_dir=warm_cache), str(tmp_path / "run"))
    assert summary["steps"] == 1


def test_file_answers_keep_the_files_text(tmp_path):
    from rlkit.tasks.files import FileTask

    (tmp_path / "d.jsonl").write_text(
        '{"prompt": "a", "answer": 1.50}\n{"prompt": "b", "answer": 12345678901234567890}\n'
        '{"prompt": "c", "answer": "x"}\n{"prompt": "d", "answer": 7}\n'
    )
    (tmp_path / "d.csv").write_text("prompt,answer\na,007\nb,1.50\nc,NA\n")
    assert FileTask(str(tmp_path / "d.jsonl"), str(tmp_path / "d.jsonl")).train["answer"] == [
        "1.50",
        "12345678901234567890",
        "x",
        "7",
    ]
    assert FileTask(str(tmp_path / "d.csv"), str(tmp_path / "d.csv"), format="csv").train["answer"] == [
        "007",
        "1.50",
        "NA",
    ]


@pytest.mark.parametrize(
    "train, message",
    [
        (GOOD + [{"prompt": "4+4="}], r"task.train row 2 \('4\+4='\) has no answer"),
        (GOOD + [{"prompt": "", "answer": "1"}], r"task.train row 2 has no prompt"),
        ([{"question": "1+1=", "answer": "2"}], r"task.train has no 'prompt' column"),
    ],
)
def test_bad_rows_are_reported_before_training(tmp_path, train, message):
    with pytest.raises(TaskError, match=message):
        run(make_cfg(file_task(tmp_path, train)), str(tmp_path / "run"))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_empty_split_is_reported(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(TaskError, match="task.eval|empty|cannot load"):
        run(
            make_cfg(file_task(tmp_path, GOOD)[:2] + [f"task.eval_path={tmp_path / 'empty.jsonl'}"]),
            str(tmp_path / "r"),
        )


def test_csv_files_empty_with_a_bom_or_with_bad_difficulties_are_named(tmp_path):
    empty = write_csv(tmp_path / "empty.csv", "")
    with pytest.raises(TaskError, match=r"task.train_path: .*empty.csv.*the file is empty: a CSV file needs a header"):
        FileTask(empty, empty, format="csv")
    ragged = write_csv(tmp_path / "ragged.csv", "prompt,answer\n1+1=,2\n2+2=,4,extra\n")
    with pytest.raises(TaskError, match=r"line 3 has 3 fields, the header 2"):
        FileTask(ragged, ragged, format="csv")
    bom = write_csv(tmp_path / "bom.csv", "prompt,answer,difficulty\n1+1=,2,1\n2+2=,4,1.5\n", bom=True)
    task = FileTask(bom, bom, format="csv")
    assert task.train.column_names == ["prompt", "answer", "difficulty"] and task.train["difficulty"] == [1.0, 1.5]

    assert by_difficulty(list(task.train), torch.tensor([1.0, 0.0]), "acc") == {"acc_d1": 1.0, "acc_d1.5": 0.0}
    words = write_csv(tmp_path / "words.csv", "prompt,answer,difficulty\n1+1=,2,1\n2+2=,4,hard\n")
    with pytest.raises(TaskError, match=r"task.train row 1 has difficulty 'hard'; the difficulty column must hold"):
        FileTask(words, words, format="csv")


def test_a_column_named_twice_is_refused_naming_it(tmp_path):
    csv = write_csv(tmp_path / "twice.csv", "prompt,answer,prompt\n1+1=,2,3+3=\n")
    with pytest.raises(TaskError, match=r"task.train_path: .*twice.csv.*names the column 'prompt' twice"):
        FileTask(csv, csv, format="csv")
    jsonl = tmp_path / "twice.jsonl"
    jsonl.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": "4", "prompt": "3+3="}\n')
    with pytest.raises(TaskError, match=r"task.eval_path: .*twice.jsonl.*names the key 'prompt' twice"):
        FileTask(write_jsonl(tmp_path / "ok.jsonl", GOOD), str(jsonl), format="json")


@pytest.mark.slow
def test_a_non_numeric_difficulty_exits_2_and_leaves_no_run_directory(tmp_path):
    data = write_csv(tmp_path / "d.csv", "prompt,answer,difficulty\n1+1=,2,easy\n")
    out = run_cli(
        [
            "task=files",
            "task.format=csv",
            f"task.train_path={data}",
            f"task.eval_path={data}",
            "steps=1",
            "warm_start.steps=0",
            "logger=jsonl",
            "hydra.run.dir=runs/a",
        ],
        cwd=tmp_path,
    )
    assert out.returncode == EXIT_BAD_INPUT and "has difficulty 'easy'" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "runs").exists()


def test_math_rows_without_a_question_are_refused_and_unmatchable_references_are_counted(tmp_path, capsys):
    from rlkit.tasks.math import Math

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": None, "answer": "#### 5"}) + "\n")
    with pytest.raises(TaskError, match=r"task.train row 0 has no 'question' \(got None\)"):
        Math(str(bad), str(bad))
    rows = [{"question": "a", "answer": "\\boxed{5}"}, {"question": "b", "answer": "\\boxed{$$}"}]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = Math(str(data), str(data), answer_style="boxed")
    assert task.unsolvable == 1
    assert "task.eval: 1 of 2 rows have a reference answer that math-verify cannot match" in capsys.readouterr().err

"""The benchmark scripts run (tiny sizes; timings are printed, never asserted)."""

import importlib.util
import json
import math
import subprocess
import tempfile
from pathlib import Path

import pytest


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, Path(__file__).parents[1] / "benchmarks" / f"{name}.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_rollout_benchmark_runs(capsys):
    bench = load("bench_rollout")
    bench.bench_generate(4, 1, max_new=4)
    bench.bench_logprobs(2, 1, prompt_len=4, completion_len=3, vocab=64)  # asserts both give the same log-probs
    out = capsys.readouterr().out
    assert "ratio" in out and "generate" in out and "logprobs" in out


def test_gpu_check_runs_on_cpu(tmp_path, monkeypatch, capsys):
    """The GPU check's dry run on CPU (the GPU numbers need a GPU; CI has none)."""
    monkeypatch.setenv("RLKIT_CACHE", str(tmp_path))
    bench = load("gpu_check")
    out = bench.check(
        [
            "warm_start.steps=0",
            "model.num_layers=1",
            "rollout.prompts_per_step=2",
            "rollout.group_size=2",
            "task.n_train=16",
            "task.n_eval=4",
        ],
        1,
        989.0,
        "cpu",
    )
    assert out["rollout tokens/s"] > 0 and out["update tokens/s"] > 0 and "MFU" not in out


TINY = [
    "threads=1",
    "model.hidden_size=32",
    "model.num_layers=1",
    "model.num_heads=2",
    "model.num_kv_heads=1",
    "model.intermediate_size=64",
    "task.n_train=16",
]


def test_rlkit_and_trl_compute_the_same_advantages_loss_and_gradient(tmp_path, monkeypatch, capsys):
    """The benchmark against TRL's GRPOTrainer first checks, on one rollout of TRL's, that both
    sides compute the same numbers; then it alternates steps (timings printed, not asserted)."""
    monkeypatch.setenv("RLKIT_CACHE", str(tmp_path))
    bench = load("bench_vs_trl")
    for mode in ("natural", "fixed"):  # fixed: with a few-shot context, where the shared prefix acts
        res = bench.compare(
            "tiny",
            mode,
            rounds=3,
            warmup=1,
            prompts=2,
            group=4,
            max_new=6,
            extra=TINY,
            context=24 if mode == "fixed" else 0,
        )
        check = res["check"]
        assert check["rows"] == 8 and (check["mean length"] == 6 or mode == "natural")
        for key in ("advantage", "reference logp", "loss", "gradient"):
            assert check[key] < 1e-5, (mode, key, check[key])
        assert len(res["rlkit"]["split"]) == 4 and (res["rlkit"]["tokens"] == 48 or mode == "natural")
        assert res["rlkit unshared"]["tokens"] == res["rlkit"]["tokens"] or mode == "natural"
        assert res["rlkit"]["activations"] > 0 and res["trl"]["activations"] > 0
        # with the context the prompt outweighs the completions, so the shared prefix runs; without it (natural) the
        # auto rule may keep packing, and the two sides draw different samples, so their ratio is noise there
        assert res["sharing"]["activations"] > 1 or mode == "natural"
        bench.report(res)
    out = capsys.readouterr().out
    assert out.count("ratio rlkit/TRL") == 2 and out.count("unshared/shared rlkit step time") == 2


@pytest.mark.slow
def test_multi_turn_benchmark_runs(capsys, monkeypatch):
    monkeypatch.setattr("sys.argv", ["bench_multi_turn", "--rows", "2", "--budget", "24", "--repeats", "1"])
    load("bench_multi_turn").main()
    out = capsys.readouterr().out
    assert "single-turn: 48 tokens" in out and "the tool's" in out and "ratio" in out


def test_the_call_path_counts_files_and_distinct_moves_by_hand():
    """a calls b, then c, then b again (and a frame outside rlkit, which is not followed): the
    innermost rlkit file runs a b a c a b a, so 3 files, 7 moves, 4 distinct ones (a->b, b->a,
    a->c, c->a; the first entry comes from outside and is no move between files)."""
    from types import SimpleNamespace

    bench = load("call_path")
    trail = bench.Trail()
    frame = {name: SimpleNamespace(f_code=SimpleNamespace(co_filename=f"{bench.ROOT}/{name}.py")) for name in "abc"}
    frame["outside"] = SimpleNamespace(f_code=SimpleNamespace(co_filename="/usr/lib/python3/os.py"))
    events = "call a, call b, call outside, return outside, return b, call c, return c, call b, return b, return a"
    for event, name in (e.split() for e in events.split(", ")):
        trail(frame[name], event, None)
    assert (len(trail.seen), trail.moves, len(trail.edges)) == (3, 7, 4)
    assert trail.stack == []


def test_the_step_benchmark_counts_flops_by_hand():
    """One layer of width 32 (MLP 64, one 16-wide key-value head), 10 words, 4 prompts of 2 tokens
    x 8 completions of 2: per token 18,432 FLOPs through the layer, 640 for the logits, 128 per
    position attended."""
    from types import SimpleNamespace

    config = SimpleNamespace(
        hidden_size=32, num_hidden_layers=1, vocab_size=10, intermediate_size=64, num_attention_heads=2
    )
    config.num_key_value_heads = 1
    got = load("bench_step").flops(config, prompt=2, tokens=2, lora=False)
    prompts = 4 * (2 * 18432 + 128 * 3)  # each position attends to itself and those before it
    assert got["generate"] == prompts + 4 * 640 + 32 * (18432 + 640 + 128 * 3)
    assert got["logprob"] == prompts + 32 * 2 * (18432 + 640 + 128 * 3.5)
    assert got["update"] == 3 * got["logprob"]
    assert load("bench_step").flops(config, prompt=2, tokens=2, lora=True)["update"] == 2 * got["logprob"]


def test_the_step_benchmark_times_this_checkout_against_a_revision(tmp_path, monkeypatch, capsys):
    """Both sides on the tiny model, the revision from a git worktree (removed after): the check
    of greedy tokens, log-probs, loss, gradients and weights, then the table of both sides."""
    monkeypatch.setenv("RLKIT_CACHE", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the revision's worktree too: this test's own
    extra = [*TINY, "warm_start.steps=0", "task.n_eval=4"]
    argv = ["bench_step", "--model", "tiny", "--against", "HEAD", "--rounds", "2", "--extra", *extra]
    monkeypatch.setattr("sys.argv", argv)
    load("bench_step").main()
    out = capsys.readouterr().out
    check = json.loads(out[out.index("{") : out.index("}") + 1])
    assert set(check) == {
        "greedy tokens identical",
        "reference log-probs",
        "loss",
        "gradients",
        "weights after the step",
        "tensors compared",
    }
    assert check["tensors compared"] > 0 and all(math.isfinite(v) for v in check.values())
    assert "| this checkout |" in out and "| HEAD |" in out and "step time this checkout / HEAD" in out
    worktrees = subprocess.run(["git", "worktree", "list"], capture_output=True, text=True, check=True).stdout
    assert list(tmp_path.glob("rlkit-bench-*")) == [] and str(tmp_path.resolve()) not in worktrees  # removed


def test_the_step_benchmarks_check_reports_each_largest_difference(tmp_path):
    """Two sides' check files that differ in one token, one log-prob, the loss, one gradient and one
    weight: each largest difference is reported, by hand."""
    import torch

    def side(token, logp, loss, grad, weight):
        path = tmp_path / f"{token}.pt"
        torch.save(
            {
                "tokens": torch.tensor([[1, token]]),
                "ref_logp": torch.tensor([[-1.0, logp]]),
                "loss": [loss],
                "grads": {"a": torch.tensor([0.5, grad]), "b": torch.zeros(2)},
                "weights": {"a": torch.tensor([weight, 1.0]), "b": torch.zeros(2)},
            },
            path,
        )
        return str(path)

    same = load("bench_step").compare_checks(side(2, -2.0, 0.25, 0.0, 1.0), side(2, -2.0, 0.25, 0.0, 1.0))
    assert same["greedy tokens identical"] and same["gradients"] == same["loss"] == 0.0
    got = load("bench_step").compare_checks(side(2, -2.0, 0.25, 0.0, 1.0), side(3, -2.5, 0.5, 0.125, 0.75))
    assert not got["greedy tokens identical"]
    assert (got["reference log-probs"], got["loss"], got["gradients"], got["weights after the step"]) == (
        0.5,
        0.25,
        0.125,
        0.25,
    )
    assert got["tensors compared"] == 2


@pytest.mark.slow
def test_the_run_benchmark_times_two_whole_runs_phase_by_phase(tmp_path, monkeypatch, capsys):
    """This checkout and HEAD (a worktree, removed after) each train a tiny run in their own
    process: the agreement line (the same code gives the same values) and a row per side."""
    monkeypatch.setenv("RLKIT_CACHE", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    sizes = [o for o in TINY if not o.startswith("threads=")]  # the benchmark sets the threads
    config = ["model=tiny", *sizes, "warm_start.steps=0", "task.n_eval=4", "checkpoint.every=0"]
    monkeypatch.setattr("sys.argv", ["bench_run", "--against", "HEAD", "--steps", "2", "--config", *config])
    load("bench_run").main()
    out = capsys.readouterr().out
    assert "first evaluation's values agree: True; steps with every training value agreeing: 2 of 2" in out
    assert "| this checkout |" in out and "| HEAD |" in out and "wall time this checkout / HEAD" in out
    assert list(tmp_path.glob("rlkit-bench-*")) == []

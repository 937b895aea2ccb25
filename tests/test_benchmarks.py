"""The benchmark scripts run (tiny sizes; timings are printed, never asserted)."""
import importlib.util
from pathlib import Path


def test_rollout_benchmark_runs(capsys):
    path = Path(__file__).parents[1] / "benchmarks" / "bench_rollout.py"
    spec = importlib.util.spec_from_file_location("bench_rollout", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.bench_generate(4, 1, max_new=4)
    bench.bench_logprobs(2, 1, prompt_len=4, completion_len=3, vocab=64)  # asserts both give the same log-probs
    out = capsys.readouterr().out
    assert "ratio" in out and "generate" in out and "logprobs" in out


def test_gpu_check_runs_on_cpu(tmp_path, monkeypatch, capsys):
    """The GPU check's dry run on CPU (the GPU numbers need a GPU; CI has none)."""
    monkeypatch.setenv("RLKIT_CACHE", str(tmp_path))
    path = Path(__file__).parents[1] / "benchmarks" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = bench.check(["warm_start.steps=0", "model.num_layers=1", "rollout.prompts_per_step=2",
                       "rollout.group_size=2", "task.n_train=16", "task.n_eval=4"], 1, 989.0, "cpu")
    assert out["rollout tokens/s"] > 0 and out["update tokens/s"] > 0 and "MFU" not in out

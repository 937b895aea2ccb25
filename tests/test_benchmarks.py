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

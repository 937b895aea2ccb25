"""Rollout and log-prob speed against the obvious peer, measured in the same run:

1. rlkit's generation loop (KV cache, per-row EOS) vs transformers' `model.generate` with the same
   sampling settings, on the same model and prompts: completion tokens per second.
2. rlkit's completion log-probs (logits only at completion positions, gather minus logsumexp)
   vs a full-sequence `log_softmax` then gather (what a straightforward trainer does): seconds
   per batch, with a realistic 32k vocabulary.

    python benchmarks/bench_rollout.py [--n 128] [--repeats 3]

Prints ratios (peer time / rlkit time): above 1 means rlkit is faster.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rlkit.engines.kv_cache import encode_prompts, generate
from rlkit.logprobs import token_logprobs
from rlkit.models import TinyQwen2
from rlkit.tasks.arithmetic import Arithmetic
from rlkit.tensors import positions


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def bench_generate(n: int, repeats: int, max_new: int = 24) -> None:
    task = Arithmetic(n_train=n, n_eval=8)
    model, tok = TinyQwen2().build(task.alphabet, 0)
    model.eval()
    prompts = list(task.train["prompt"])[:n]
    ids, mask = encode_prompts(tok, prompts)

    def ours():
        torch.manual_seed(0)
        return generate(model, tok, prompts, max_new, temperature=1.0)

    def peer():
        torch.manual_seed(0)
        with torch.no_grad():
            return model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                max_new_tokens=max_new,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
            )

    tokens = int(ours()[3].sum())
    t_ours, t_peer = best_of(ours, repeats), best_of(peer, repeats)
    print(
        f"generate  n={n}: rlkit {tokens / t_ours:8.0f} tok/s, transformers.generate {tokens / t_peer:8.0f} tok/s "
        f"(ratio {t_peer / t_ours:.2f}x)"
    )


def bench_logprobs(n: int, repeats: int, prompt_len: int = 96, completion_len: int = 32, vocab: int = 32000) -> None:
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=384,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    pid = torch.randint(0, vocab, (n, prompt_len))
    cid = torch.randint(0, vocab, (n, completion_len))
    pmask, cmask = torch.ones_like(pid), torch.ones_like(cid)

    @torch.no_grad()
    def ours():
        return token_logprobs(model, pid, pmask, cid, cmask)[0]

    @torch.no_grad()
    def peer():
        ids, mask = torch.cat([pid, cid], 1), torch.cat([pmask, cmask], 1)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask)).logits  # [N, S, V]
        logp = torch.log_softmax(logits.float(), -1)[:, prompt_len - 1 : -1]  # [N, Tc, V]
        return logp.gather(-1, cid.unsqueeze(-1)).squeeze(-1)

    assert torch.allclose(ours(), peer(), atol=1e-4)
    t_ours, t_peer = best_of(ours, repeats), best_of(peer, repeats)
    full = n * (prompt_len + completion_len) * vocab * 4 / 2**20
    kept = n * (completion_len + 1) * vocab * 4 / 2**20
    print(
        f"logprobs  n={n}: rlkit {t_ours * 1e3:7.1f} ms, full log_softmax {t_peer * 1e3:7.1f} ms "
        f"(ratio {t_peer / t_ours:.2f}x); logits held {kept:.0f} MiB vs {2 * full:.0f} MiB (logits + log_softmax)"
    )


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    bench_generate(a.n, a.repeats)
    bench_logprobs(min(a.n, 32), a.repeats)

"""Generation with a KV cache and left padding, masks, and log-probs, on a real tiny Qwen2."""

import pytest
import torch

from rlkit.aggregators import SeqMeanTokenMean
from rlkit.engines.kv_cache import encode_prompts, generate
from rlkit.logprobs import token_logprobs
from rlkit.models import TinyQwen2
from rlkit.tasks.arithmetic import ALPHABET
from rlkit.types import Rollout


@pytest.fixture(scope="module")
def model_tok():
    model, tok = TinyQwen2(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64).build(
        ALPHABET, 0
    )
    return model.eval(), tok


PROMPTS = ["1+2=", "13+4+5=", "7+7=", "9+1+0+3="]  # different lengths -> left padding


def test_masks_include_eos_and_stop_per_row(model_tok):
    model, tok = model_tok
    torch.manual_seed(0)
    _, _, ids, mask, truncated = generate(model, tok, PROMPTS * 8, max_new_tokens=10)[:5]
    eos = tok.eos_token_id
    for row, m, tr in zip(ids.tolist(), mask.tolist(), truncated.tolist()):
        n = sum(m)
        assert m == [1] * n + [0] * (len(m) - n)  # contiguous completion
        assert all(t == tok.pad_token_id for t in row[n:])
        if tr:
            assert eos not in row[:n] and n == 10
        else:
            assert row[n - 1] == eos and eos not in row[: n - 1]  # EOS included, first EOS ends the row


def test_greedy_with_cache_matches_full_forward_without_cache(model_tok):
    model, tok = model_tok
    _, _, ids, mask, _ = generate(model, tok, PROMPTS, max_new_tokens=6, temperature=0)[:5]
    for p, row, m in zip(PROMPTS, ids, mask):
        seq = tok(p, return_tensors="pt")["input_ids"]  # unpadded, no cache
        for _ in range(int(m.sum())):
            nxt = model(input_ids=seq).logits[0, -1].argmax()
            seq = torch.cat([seq, nxt.view(1, 1)], 1)
        assert seq[0, -int(m.sum()) :].tolist() == row[: int(m.sum())].tolist()


def test_logprobs_match_log_softmax_of_unpadded_sequence(model_tok):
    model, tok = model_tok
    torch.manual_seed(1)
    pid, pmask, cid, cmask, _ = generate(model, tok, PROMPTS, max_new_tokens=5, temperature=0.7)[:5]
    logp, ent = token_logprobs(model, pid, pmask, cid, cmask, temperature=0.7, entropy="metric")  # [N, Tc]
    for i, p in enumerate(PROMPTS):
        n = int(cmask[i].sum())
        seq = torch.cat([tok(p, return_tensors="pt")["input_ids"][0], cid[i, :n]])[None]
        full = torch.log_softmax(model(input_ids=seq).logits[0, -n - 1 : -1] / 0.7, -1)  # [n, V]
        assert torch.allclose(logp[i, :n], full.gather(-1, cid[i, :n, None]).squeeze(-1), atol=1e-5)
        assert torch.allclose(ent[i, :n], -(full.exp() * full).sum(-1), atol=1e-5)


def test_top_p_tiny_keeps_only_the_argmax(model_tok):
    model, tok = model_tok
    greedy = generate(model, tok, PROMPTS, max_new_tokens=6, temperature=0)[2]
    nucleus = generate(model, tok, PROMPTS, max_new_tokens=6, temperature=1.0, top_p=1e-6)[2]
    assert torch.equal(greedy, nucleus)


def test_micro_batches_give_the_full_batch_gradient(model_tok):
    model, tok = model_tok
    torch.manual_seed(2)
    pid, pmask, cid, cmask, _ = generate(model, tok, PROMPTS * 2, max_new_tokens=6)[:5]
    adv = torch.randn(8, 1) * cmask  # [N, Tc]
    w = SeqMeanTokenMean().token_weights(cmask)

    def grads(size):
        model.zero_grad()
        for idx in torch.arange(8).split(size):
            logp, _ = token_logprobs(model, pid[idx], pmask[idx], cid[idx], cmask[idx])
            (-(logp * adv[idx]) * w[idx]).sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    for a, b in zip(grads(8), grads(3)):
        assert torch.allclose(a, b, atol=1e-6)


def test_rollout_cat_and_select_groups(model_tok):
    model, tok = model_tok
    parts = []
    for prompts in (PROMPTS[:2], PROMPTS[2:]):
        pid, pmask, cid, cmask, tr = generate(model, tok, [p for p in prompts for _ in range(2)], 4 + len(parts))[:5]
        parts.append(
            Rollout(
                pid,
                pmask,
                cid,
                cmask,
                tr,
                2,
                texts=[p for p in prompts for _ in range(2)],
                rewards=torch.arange(4.0) + 10 * len(parts),
            )
        )
    r = Rollout.cat(parts)
    assert r.num_groups == 4 and r.prompt_ids.shape[0] == 8
    assert r.texts == [p for p in PROMPTS for _ in range(2)]
    kept = r.select_groups(torch.tensor([3, 0]))
    assert kept.rewards.tolist() == [12.0, 13.0, 0.0, 1.0] and kept.texts[0] == PROMPTS[3]
    # re-padding keeps each row's tokens
    ids, _ = encode_prompts(tok, PROMPTS[3:])
    assert kept.prompt_ids[0, -ids.shape[1] :].tolist() == ids[0].tolist()


def test_entropy_carries_a_gradient_only_when_asked(model_tok):
    model, tok = model_tok
    pid, pmask, cid, cmask, _ = generate(model, tok, PROMPTS, max_new_tokens=4)[:5]
    _, metric = token_logprobs(model, pid, pmask, cid, cmask, entropy="metric")
    assert not metric.requires_grad
    _, ent = token_logprobs(model, pid, pmask, cid, cmask, entropy="grad")
    model.zero_grad()
    (ent * cmask).sum().backward()  # an entropy bonus moves the weights
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())

"""Each group's prompt computed once: the shared-prefix forward gives the log-probs, entropies and
gradients of the unshared one, for groups of different prompt lengths, groups of one, any
micro-batch split and LoRA; a model it cannot apply to runs unshared and says so once."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import GPT2Config, GPT2LMHeadModel

from rlkit import logprobs
from rlkit.engines.kv_cache import generate
from rlkit.llama import SharedLayout
from rlkit.logprobs import token_logprobs
from rlkit.models import TinyQwen2

# few-shot prompts of different lengths (25 to 47 tokens), longer than the completions, so sharing pays
PROMPTS = ["1+1=2;" * 6 + "12+3=", "2+2=4;3+1=4;" * 2 + "1+2+34+5=", "5+5=10;" * 5 + "7=", "9+0=9;" * 3 + "40+1+1="]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return TinyQwen2(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128).build(
        "0123456789+=;", 0
    )


def rollout(model, group_sizes):
    policy, tok = model
    prompts = [p for p, g in zip(PROMPTS, group_sizes) for _ in range(g)]
    torch.manual_seed(1)
    return generate(policy, tok, prompts, 12)[:4]  # prompt ids and mask, completion ids and mask


def forward_backward(policy, g, share, rows=None):
    """Log-probs, entropies and the gradient of sum(logp + 0.1 entropy) over `rows` (default all);
    `share`: optim.share_prefix's auto, always or never."""
    policy.zero_grad()
    rows = torch.arange(len(g[0])) if rows is None else rows
    logp, ent = token_logprobs(policy, *(t[rows] for t in g), temperature=0.7, entropy="grad", share=share)
    (logp.sum() + 0.1 * ent.sum()).backward()
    return logp.detach(), ent.detach(), torch.cat([p.grad.flatten() for p in policy.parameters() if p.requires_grad])


def assert_close(a, b):
    """Within 1e-5 of the reference's size (a gradient's norm; per element for log-probs)."""
    if a.dim() == 1:  # a flattened gradient
        assert float((a - b).norm() / a.norm()) < 1e-5, float((a - b).norm() / a.norm())
    else:
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5), (a - b).abs().max()


@pytest.mark.parametrize("groups", [(4, 4, 4, 4), (1, 1, 1, 1), (3, 1, 5, 2)])
def test_shared_and_unshared_forwards_agree(model, groups):
    g = rollout(model, groups)
    assert logprobs.shares_prefix(model[0], g[0], g[1], g[3]) == (groups != (1, 1, 1, 1))  # groups of one: packed
    assert logprobs.shares_prefix(model[0], g[0], g[1], g[3], "always")
    unshared = forward_backward(model[0], g, "never")
    for mode in ("auto", "always"):  # groups of one: auto packs, always shares (each prompt is its own)
        for a, b in zip(unshared, forward_backward(model[0], g, mode)):
            assert_close(a, b)


def test_each_distinct_prompt_goes_through_the_decoder_once(model):
    """The embedding sees the 4 distinct (padded) prompts once and the completions once, packed
    into fewer rows than there are completions."""
    policy, _ = model
    g = rollout(model, (3, 1, 5, 2))
    seen = []
    hook = policy.model.embed_tokens.register_forward_hook(lambda m, args, out: seen.append(args[0].numel()))
    try:
        token_logprobs(policy, *g, share="always")
    finally:
        hook.remove()
    tc, packed = int(g[3].any(0).nonzero().max()) + 1, len(SharedLayout(*g).ids)
    assert packed < 11 and sum(seen) == 4 * g[0].shape[1] + packed * tc  # prompts [4, Tp], completions [B, tc]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 9)), min_size=1, max_size=12))
def test_completions_are_packed_within_their_group_without_overlap(rows):
    """Each completion's tokens sit in a packed row of its own prompt's, at consecutive columns
    from its offset, with its position ids continuing its prompt; no cell holds two completions."""
    owner, length = torch.tensor([o for o, _ in rows]), torch.tensor([n for _, n in rows])
    Tp = 6
    prompt_ids = (owner[:, None] + 10 * torch.arange(Tp)).long()  # [n, Tp] distinct per owner
    prompt_mask = (torch.arange(Tp)[None] >= owner[:, None]).long()  # [n, Tp] prompt u: Tp - u tokens
    width = max(int(length.max()), 1)
    c_mask = (torch.arange(width)[None] < length[:, None]).long()  # [n, W]
    c_ids = torch.arange(len(rows) * width).view(len(rows), width) + 100  # [n, W] every token distinct
    s = SharedLayout(prompt_ids, prompt_mask, c_ids, c_mask)
    assert s.ids.shape[1] == width and len(s.ids) <= len(rows)
    held = torch.zeros_like(s.seq)
    for r, n in enumerate(length.tolist()):
        b, cols = int(s.bins[r]), int(s.offset[r]) + torch.arange(n)
        assert int(s.prompts[s.bin_owner[b], -1]) == int(prompt_ids[r, -1])  # its own prompt's row
        assert torch.equal(s.ids[b, cols], c_ids[r, :n]) and torch.equal(s.seq[b, cols], torch.full((n,), r))
        assert torch.equal(s.pos[b, cols], (Tp - owner[r]) + torch.arange(n))  # positions go on from the prompt
        held[b, cols] += 1
    assert held.max() <= 1 and int((s.seq >= 0).sum()) == int(length.sum())


@settings(max_examples=5, deadline=None)
@given(st.permutations(range(11)), st.integers(1, 10))
def test_any_micro_batch_split_gives_the_same_gradient(model, order, cut):
    """Rows of a group split across micro-batches share within each; the summed gradient is the same."""
    g = rollout(model, (3, 1, 5, 2))
    whole = forward_backward(model[0], g, "never")[2]
    order = torch.tensor(order)
    grads = [forward_backward(model[0], g, "always", rows)[2] for rows in (order[:cut], order[cut:])]
    assert_close(whole, grads[0] + grads[1])


def test_lora_adapters_get_the_same_gradient(model, tmp_path):
    import copy

    from peft import LoraConfig, get_peft_model

    policy = get_peft_model(copy.deepcopy(model[0]), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_alpha=8))
    with torch.no_grad():
        for n, p in policy.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)  # lora_B starts at zero; give the adapters an effect
    g = rollout(model, (4, 4, 4, 4))
    for a, b in zip(forward_backward(policy, g, "never"), forward_backward(policy, g, "always")):
        assert_close(a, b)


def test_a_model_it_cannot_apply_to_runs_unshared_and_says_so_once(model, capsys):
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=model[0].config.vocab_size, n_embd=32, n_layer=1, n_head=2)).eval()
    g = rollout(model, (2, 2, 2, 2))
    logprobs._UNSHARED.discard("GPT2LMHeadModel")
    a = token_logprobs(gpt2, *g, share="always")[0]
    token_logprobs(gpt2, *g, share="auto")
    assert torch.equal(a, token_logprobs(gpt2, *g, share="never")[0])
    assert capsys.readouterr().err.count("GPT2LMHeadModel runs every row's prompt in full") == 1


@pytest.mark.parametrize("fast", [True, False])
def test_a_prompt_given_several_times_is_prefilled_once_with_the_same_completions(model, fast):
    """Greedy completions of each prompt repeated 3 times (a group's prompt prefilled once, its
    cache copied to the rows) equal those of the prompts given once."""
    policy, tok = model
    once = generate(policy, tok, PROMPTS, 12, temperature=0, fast=fast)
    grouped = generate(policy, tok, [p for p in PROMPTS for _ in range(3)], 12, temperature=0, fast=fast)
    T = once.completion_ids.shape[1]
    assert torch.equal(grouped.completion_ids[:, :T], once.completion_ids.repeat_interleave(3, 0))
    assert torch.equal(grouped.prompt_ids, once.prompt_ids.repeat_interleave(3, 0))


@pytest.mark.parametrize("groups", [(4, 4, 4, 4), (1, 1, 1, 1), (3, 1, 5, 2), (6, 0, 0, 0)])
@pytest.mark.parametrize("common", ["", "0+0=0;" * 3])
def test_the_decoder_gives_the_packed_forwards_log_probs_and_entropies(model, groups, common):
    """`decoded=True` (the probe's no-gradient path): the prefix every row shares (none, a few-shot
    preamble, or a whole prompt and the completions' first tokens when one prompt is repeated)
    computed once, LoRA folded; rows of different prompt and completion lengths."""
    import copy

    from peft import LoraConfig, get_peft_model

    policy = get_peft_model(copy.deepcopy(model[0]), LoraConfig(r=4, target_modules="all-linear", lora_alpha=8))
    with torch.no_grad():
        for n, p in policy.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)  # lora_B starts at zero; give the adapters an effect
    prompts = [common + p for p, g in zip(PROMPTS, groups) for _ in range(g)]
    torch.manual_seed(1)
    g = generate(policy, model[1], prompts, 12)[:4]
    assert len(set(g[3].sum(-1).tolist())) > 1  # completions of different lengths
    with torch.no_grad():
        packed = token_logprobs(policy, *g, temperature=0.7, entropy="metric")
        decoded = token_logprobs(policy, *g, temperature=0.7, entropy="metric", decoded=True)
    for a, b in zip(packed, decoded):
        assert_close(a, b)
    assert (packed[0] != 0).sum() == g[3].sum()  # a log-prob at every completion token, none on padding


def test_the_sum_of_squared_probabilities_is_the_softmaxs(model):
    """`entropy="sum_pi_squared"` (the optimal token baseline's statistic): sum_v pi_v^2 of the
    distribution at the temperature before each completion token, from the model's plain forward."""
    policy, tok = model
    g = rollout(model, (3, 1, 5, 2))
    with torch.no_grad():
        _, sq = token_logprobs(policy, *g, temperature=0.7, entropy="sum_pi_squared")  # [N, Tc]
        for i in range(len(g[0])):
            p, c = g[0][i][g[1][i].bool()], g[2][i][g[3][i].bool()]
            probs = torch.softmax(policy(torch.cat([p, c])[None]).logits[0, len(p) - 1 : -1] / 0.7, -1)  # [tc, V]
            torch.testing.assert_close(sq[i, : len(c)], (probs**2).sum(-1), rtol=1e-5, atol=1e-6)
    assert (sq[g[3] == 0] == 0).all()

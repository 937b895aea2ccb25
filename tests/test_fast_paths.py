"""The fast paths give the plain computation's numbers: the Llama decoder's greedy tokens are
`model.generate`'s, sampling draws from the softmax, packed and trimmed log-probs and their
gradients equal the padded ones, length-sorted micro-batches cover every row once."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from peft import LoraConfig, get_peft_model
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from rlkit import projections
from rlkit.engines.decoders import decoder
from rlkit.engines.kv_cache import encode_prompts, generate
from rlkit.engines.sampling import sample as _sample
from rlkit.llama import LlamaDecoder, causal_parts, shared_prefix_layout
from rlkit.logprobs import token_logprobs
from rlkit.models import AdaptersOff, TinyQwen2
from rlkit.projections import FEW_ROWS, fused, head
from rlkit.tasks.arithmetic import ALPHABET
from rlkit.tensors import pack, positions
from rlkit.types import Rollout

PROMPTS = ["1+2=", "13+4+5=", "7+7=", "9+1+0+3=", "5=", "2+2+2+2+2="] * 4  # left padding of several widths


def tiny_qwen2():
    model, tok = TinyQwen2(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64).build(
        ALPHABET, 0
    )
    return model.eval(), tok


def other_models(tok):
    """A Llama and a Qwen3 (Llama decoder) and a GPT-2 (the model's own forward), random weights."""
    common = dict(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    llama = dict(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        **common,
    )
    torch.manual_seed(0)
    return {
        "llama": LlamaForCausalLM(LlamaConfig(**llama)).eval(),
        "qwen3": Qwen3ForCausalLM(Qwen3Config(head_dim=8, **llama)).eval(),
        "gpt2": GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=64, **common)).eval(),
    }


def reference_greedy(model, tok, prompts, n):
    ids, mask = encode_prompts(tok, prompts)
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=n,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    return out[:, ids.shape[1] :]  # [N, <=n]


def test_greedy_generation_equals_model_generate_for_lean_and_generic_decoders():
    model, tok = tiny_qwen2()
    models = {"qwen2": model, **other_models(tok)}
    assert [isinstance(decoder(m, *encode_prompts(tok, PROMPTS[:1]), 4), LlamaDecoder) for m in models.values()] == [
        True,
        True,
        True,
        False,
    ]
    for name, m in models.items():
        want = reference_greedy(m, tok, PROMPTS, 12)
        for fast in (True, False):
            g = generate(m, tok, PROMPTS, 12, temperature=0, fast=fast)
            got = g.completion_ids.masked_fill(g.completion_mask == 0, tok.pad_token_id)  # [N, T]
            assert got.shape[1] == want.shape[1], name
            # model.generate pads finished rows with the pad id as well
            assert torch.equal(got, want.masked_fill(got == tok.pad_token_id, tok.pad_token_id)), (name, fast)


def test_llama_and_generic_decoders_sample_the_same_tokens_from_the_same_seed():
    """Same maths, same random stream: the two decoders draw identical samples, rows leaving
    the batch included."""
    model, tok = tiny_qwen2()
    runs = []
    for fast in (True, False):
        torch.manual_seed(3)
        runs.append(generate(model, tok, PROMPTS, 16, temperature=1.0, fast=fast))
    assert torch.equal(runs[0].completion_ids, runs[1].completion_ids)
    assert torch.equal(runs[0].completion_mask, runs[1].completion_mask)
    assert runs[0].completion_mask.sum(-1).unique().numel() > 2  # rows finished at different steps and left


def test_the_prefix_every_prompt_shares_moves_to_the_front_and_keeps_its_positions():
    ids = torch.tensor([[0, 0, 5, 6, 7], [5, 6, 7, 8, 9], [0, 5, 6, 8, 8]])  # [3, 5] left-padded with 0
    mask = (ids != 0).long()
    L, laid, moved = shared_prefix_layout(ids, mask)
    assert L == 2  # "5 6" is every row's start; "5 6 7" would leave row 0 nothing of its own
    assert moved.tolist() == [[1, 1, 0, 0, 1], [1, 1, 1, 1, 1], [1, 1, 0, 1, 1]]
    assert laid[moved.bool()].tolist() == [5, 6, 7, 5, 6, 7, 8, 9, 5, 6, 8, 8]
    assert positions(moved.long())[moved.bool()].tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 3]
    assert shared_prefix_layout(ids[:1], mask[:1])[0] == 0  # one row: nothing to share
    assert shared_prefix_layout(torch.tensor([[5, 6], [7, 6]]), torch.ones(2, 2, dtype=torch.long))[0] == 0


def test_prompts_with_a_common_prefix_decode_what_model_generate_does():
    """The shared prefix is prefilled once (one row, its keys copied to all) and greedy tokens stay
    `model.generate`'s, for prompts of several lengths under left padding."""
    model, tok = tiny_qwen2()
    prompts = ["12+34+5=", "12+34+56+7=", "12+3=", "12+34+5+6+7+8=", "12+34="]
    for name, m in {"qwen2": model, **other_models(tok)}.items():
        if name == "gpt2":
            continue
        assert decoder(m, *encode_prompts(tok, prompts), 4).shared == 4, name  # BOS and "12+" (row "12+3=" keeps "3=")
        want = reference_greedy(m, tok, prompts, 12)
        g = generate(m, tok, prompts, 12, temperature=0)
        got = g.completion_ids.masked_fill(g.completion_mask == 0, tok.pad_token_id)  # [N, T]
        assert torch.equal(got, want.masked_fill(got == tok.pad_token_id, tok.pad_token_id)), name


def whole_row_sample(logits, temperature, top_p, u):
    """The sampler's formula over the whole vocabulary: a full sort for top-p, one float64 running sum."""
    probs = torch.softmax(logits / temperature, -1)  # [N, V]
    order = torch.arange(probs.shape[-1]).expand_as(probs)  # [N, V]
    if top_p < 1.0:
        probs, order = probs.sort(-1, descending=True)  # [N, V] each
        probs = probs.masked_fill(probs.cumsum(-1) - probs > top_p, 0.0)
    cdf = probs.double().cumsum(-1)  # [N, V]
    tok = torch.searchsorted(cdf, u[:, None] * cdf[:, -1:], right=True).clamp_(max=cdf.shape[-1] - 1)  # [N, 1]
    return order.gather(-1, tok).squeeze(-1)  # [N]


@settings(max_examples=40, deadline=None)
@given(
    st.integers(0, 2**31 - 1),
    st.sampled_from([0.3, 1.0, 3.0, 8.0]),
    st.sampled_from([1.0, 0.7]),
    st.sampled_from([0.5, 0.9, 0.99, 1.0]),
)
def test_the_two_level_sampler_draws_the_token_of_one_running_sum_over_the_whole_vocabulary(seed, spread, temp, top_p):
    """Block totals then a running sum inside one block, and a nucleus found among the top k, give
    the token of the plain formula (sort, one running sum) for the same uniforms, over SmolLM2's
    vocabulary size, from flat to peaked distributions."""
    g = torch.Generator().manual_seed(seed)
    V = 49152
    ranks = torch.stack([torch.randperm(V, generator=g) for _ in range(8)]).float()  # [N, V]
    logits = spread * (4 * ranks / V - 2)  # [N, V] no two probabilities equal (a tie may sort either way)
    u = torch.rand(8, dtype=torch.float64, generator=g)  # [N]
    assert torch.equal(_sample(logits, temp, top_p, u), whole_row_sample(logits, temp, top_p, u))


def test_sampling_draws_from_the_softmax():
    torch.manual_seed(0)
    inf = float("-inf")
    logits = torch.tensor([[2.0, inf, 1.0, 0.0, -1.0, inf]]).expand(40000, -1)  # [N, V] zeros inside and at the end
    freq = torch.bincount(_sample(logits, 0.7, 1.0), minlength=6).float() / 40000
    want = torch.softmax(logits[0] / 0.7, -1)
    assert torch.allclose(freq, want, atol=0.01) and freq[1] == 0 and freq[5] == 0
    nucleus = torch.bincount(_sample(logits, 1.0, 0.7), minlength=6).float() / 40000  # {0, 2} hold 0.88 > 0.7
    p = torch.softmax(logits[0], -1)[[0, 2]]
    assert torch.allclose(nucleus[[0, 2]], p / p.sum(), atol=0.01) and nucleus[[1, 3, 4, 5]].sum() == 0


def test_sampling_keeps_each_share_over_a_real_vocabulary():
    """SmolLM2's 49,152 entries: a token of share 0.05 placed last and one of 0.3 in the middle are
    drawn at their rates (within 4 standard errors over 4,096 draws), the flat rest at its own."""
    V, n = 49152, 128 * 32
    p = torch.full((V,), 0.65 / (V - 2))
    p[V // 2], p[-1] = 0.3, 0.05
    torch.manual_seed(1)
    draws = torch.cat([_sample(p.log().expand(128, -1), 1.0, 1.0) for _ in range(32)])  # [n]
    freq = torch.bincount(draws, minlength=V).double() / n
    for i in (V // 2, V - 1):
        assert abs(freq[i] - p[i]) < 4 * (p[i] * (1 - p[i]) / n) ** 0.5
    rest = 1 - freq[V // 2] - freq[-1]
    assert abs(rest - 0.65) < 4 * (0.65 * 0.35 / n) ** 0.5


def test_min_new_tokens_suppresses_eos_until_then():
    model, tok = tiny_qwen2()
    torch.manual_seed(0)
    g = generate(model, tok, PROMPTS, 10, temperature=1.0, min_new_tokens=6)
    lengths = g.completion_mask.sum(-1)
    assert (lengths >= 6).all() and (g.completion_ids[:, :5] != tok.eos_token_id).all()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=60))
def test_packing_places_every_row_inside_one_packed_row_without_overlap(lengths):
    width = max(lengths)
    bins, offset, B = pack(lengths, width)
    used = [[0] * width for _ in range(B)]
    for b, o, n in zip(bins, offset, lengths):
        assert 0 <= b < B and 0 <= o and o + n <= width
        for c in range(o, o + n):
            used[b][c] += 1
    assert max(max(row) for row in used) == 1
    assert B <= len(lengths) and B >= -(-sum(lengths) // width)


def sampled(model, tok, seed=2, n=10):
    torch.manual_seed(seed)
    return generate(model, tok, PROMPTS, n, temperature=1.0)


def weighted_grads(model, g, packed: bool, micro=None):
    """Gradient of a weighted sum of log-probs and entropies over the completion tokens, in the
    given micro-batches (rows), and the log-probs."""
    w = torch.randn(g.completion_ids.shape, generator=torch.Generator().manual_seed(1)) * g.completion_mask
    model.zero_grad(set_to_none=True)
    out = torch.zeros(g.completion_ids.shape)
    for idx in micro or [torch.arange(len(w))]:
        logp, ent = token_logprobs(
            model,
            g.prompt_ids[idx],
            g.prompt_mask[idx],
            g.completion_ids[idx],
            g.completion_mask[idx],
            0.9,
            "grad",
            packed=packed,
        )  # [m, Tc] each
        ((logp + 0.1 * ent) * w[idx]).sum().backward()
        out[idx] = logp.detach()
    return out, torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def assert_same(a, b, mask):
    (la, ga), (lb, gb) = a, b
    assert torch.allclose(la[mask.bool()], lb[mask.bool()], atol=1e-5)
    assert (ga - gb).abs().max() <= 1e-5 * max(1.0, float(gb.abs().max()))


def test_unpadded_log_probs_and_gradient_equal_the_padded_ones():
    """Packed rows (Llama family), trimmed micro-batches (any model) and the plain padded forward
    over the whole batch give the same log-probs and gradient."""
    model, tok = tiny_qwen2()
    g = sampled(model, tok)
    model.train()
    ids = torch.cat([g.prompt_ids, g.completion_ids], 1)
    mask = torch.cat([g.prompt_mask, g.completion_mask], 1)
    Tc = g.completion_ids.shape[1]

    def padded():  # the whole padded batch through the model's forward, no trimming, no packing
        w = torch.randn(g.completion_ids.shape, generator=torch.Generator().manual_seed(1)) * g.completion_mask
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask)).logits[:, -Tc - 1 : -1] / 0.9
        logp_all = torch.log_softmax(logits.float(), -1)  # [N, Tc, V]
        logp = logp_all.gather(-1, g.completion_ids[..., None]).squeeze(-1)
        ent = -(logp_all.exp() * logp_all).sum(-1)
        ((logp + 0.1 * ent) * w).sum().backward()
        return logp.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])

    want = padded()
    assert causal_parts(model) is not None
    assert_same(weighted_grads(model, g, packed=True), want, g.completion_mask)
    assert_same(weighted_grads(model, g, packed=False), want, g.completion_mask)
    split = [torch.tensor([0, 5, 9]), torch.tensor([1, 2, 3, 4]), torch.arange(6, 9), torch.arange(10, len(PROMPTS))]
    assert_same(weighted_grads(model, g, packed=True, micro=split), want, g.completion_mask)


def test_packed_log_probs_under_lora_and_for_the_adapters_off_reference():
    model, tok = tiny_qwen2()
    g = sampled(model, tok)
    args = (g.prompt_ids, g.prompt_mask, g.completion_ids, g.completion_mask)
    with torch.no_grad():
        base = token_logprobs(model, *args, packed=False)[0]  # before the adapters go in
    lora = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "up_proj"], lora_dropout=0.0))
    for p in (p for n, p in lora.named_parameters() if "lora_B" in n):
        torch.nn.init.normal_(p, std=0.1)  # adapters that change the output
    assert_same(weighted_grads(lora, g, packed=True), weighted_grads(lora, g, packed=False), g.completion_mask)
    ref = AdaptersOff(lora)
    with torch.no_grad():
        off, on = token_logprobs(ref, *args)[0], token_logprobs(lora, *args)[0]
    m = g.completion_mask.bool()
    assert torch.allclose(off[m], base[m], atol=1e-5) and not torch.allclose(on[m], base[m], atol=1e-3)


@pytest.mark.parametrize("onednn", [True, False])
def test_the_decoder_runs_lora_adapters_beside_its_kept_weights_and_decodes_what_the_peft_model_does(
    onednn, monkeypatch
):
    """Decoding a LoRA policy runs each fused projection on the base weights (reordered once and
    kept while frozen) plus the adapters' low-rank product: the same outputs as peft's layers for a
    decode step's few rows and a prefill's many, the same greedy tokens as `model.generate`, the
    same logits to float rounding; adapters trained in between, or turned off, are decoded as they
    are now. Both copies of the weights: reordered for oneDNN, and input-major (a CPU without oneDNN)."""
    monkeypatch.setattr(projections, "ONEDNN", projections.ONEDNN and onednn)
    model, tok = tiny_qwen2()
    base_logits = decoder(model, *encode_prompts(tok, PROMPTS), 4).prefill()  # [N, V] before the adapters go in
    lora = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "up_proj"], lora_dropout=0.0))
    for p in (p for n, p in lora.named_parameters() if "lora_B" in n):
        torch.nn.init.normal_(p, std=0.3)  # adapters that change the output
    lora.eval()
    layer = lora.get_base_model().model.layers[0]
    qkv = (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj)
    for rows in (3, FEW_ROWS + 5):  # the reordered weights, then the weights as they are
        x = torch.randn(rows, 32)
        with torch.no_grad():
            want = torch.cat([m(x) for m in qkv], -1)  # [rows, sum out]
            assert torch.allclose(fused(*qkv)(x), want, atol=1e-5)
            assert torch.allclose(head(lora.get_base_model().lm_head)(x), lora.get_base_model().lm_head(x), atol=1e-5)
    assert not torch.allclose(qkv[0](x), qkv[0].base_layer(x), atol=1e-2)
    ids, mask = encode_prompts(tok, PROMPTS)

    def peft_logits():  # [N, V]
        with torch.no_grad():
            return lora(input_ids=ids, attention_mask=mask, position_ids=positions(mask)).logits[:, -1]

    got = decoder(lora, ids, mask, 4).prefill()  # [N, V]
    assert torch.allclose(got, peft_logits(), atol=1e-5) and not torch.allclose(got, base_logits, atol=1e-2)
    greedy = generate(lora, tok, PROMPTS, 12, temperature=0)
    ours = greedy.completion_ids.masked_fill(greedy.completion_mask == 0, tok.pad_token_id)  # [N, T]
    theirs = reference_greedy(lora, tok, PROMPTS, 12)
    assert torch.equal(ours, theirs.masked_fill(ours == tok.pad_token_id, tok.pad_token_id))
    with torch.no_grad():  # an adapter trained, a frozen base weight changed in place: decoded as they are now
        next(p for n, p in lora.named_parameters() if "lora_B" in n).add_(0.5)
        qkv[1].weight.mul_(1.5)  # k_proj: no adapter, frozen
    now = decoder(lora, ids, mask, 4).prefill()  # [N, V]
    assert torch.allclose(now, peft_logits(), atol=1e-5) and not torch.allclose(now, got, atol=1e-2)
    with lora.disable_adapter():
        assert torch.allclose(decoder(lora, ids, mask, 4).prefill(), peft_logits(), atol=1e-6)


def test_micro_batches_cover_every_row_once_within_the_limits():
    model, tok = tiny_qwen2()
    g = sampled(model, tok, n=12)
    r = Rollout.from_generation(g, group_size=4)
    rows = torch.tensor([3, 7, 1, 0, 12, 20, 21, 22, 5])
    plen, clen = r.prompt_mask.sum(-1), r.completion_mask.sum(-1)
    for max_rows, max_tokens in ((0, 0), (2, 0), (0, 40), (3, 30), (0, 1)):
        parts = r.micro_batches(rows, max_rows, max_tokens)
        assert sorted(torch.cat(parts).tolist()) == list(range(len(rows)))
        for part in parts:
            idx = rows[part]
            assert not max_rows or len(part) <= max_rows
            assert not max_tokens or len(part) == 1 or len(part) * int(plen[idx].max() + clen[idx].max()) <= max_tokens
    assert len(r.micro_batches(rows, 0, 0)) == 1

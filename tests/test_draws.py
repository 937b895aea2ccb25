"""Keyed draws (`rollout.coupled=true`): each row's uniforms are its own, so its tokens do not
depend on the other rows of its batch, coupled runs at one seed are identical, and two arms that
differ in one mechanism share their first step's rollout token for token."""

import torch

from cli import metrics
from conftest import make_cfg
from rlkit.draws import RowDraws
from rlkit.engines import KVCache
from rlkit.engines.kv_cache import generate
from rlkit.evaluate import Sampling, sampled_answers
from rlkit.models import TinyQwen2
from rlkit.session import run
from rlkit.tasks.arithmetic import ALPHABET

PROMPTS = ["1+2=", "13+4+5=", "7+7=", "9+1+0+3=", "5=", "2+2+2+2+2="]


def test_a_rows_uniforms_are_its_own_and_spread_evenly_over_0_1():
    draws = RowDraws.of_groups(7, "rollout", (3, 0), [p for p in PROMPTS for _ in range(4)], 4)
    every = torch.arange(24)
    for t in (0, 5):
        assert torch.equal(draws.at(every, t)[[2, 9, 17]], draws.at(torch.tensor([17, 2, 9]), t)[[1, 2, 0]])
    again = RowDraws.of_groups(7, "rollout", (3, 0), [p for p in PROMPTS for _ in range(4)], 4)
    assert torch.equal(again.at(every, 1), draws.at(every, 1))  # a pure function of the keys
    other = [
        RowDraws.of_groups(s, "rollout", c, PROMPTS, 1).at(torch.arange(6), 0) for s, c in ((8, (3, 0)), (7, (4, 0)))
    ]
    assert all(not torch.equal(o, draws.at(torch.arange(0, 24, 4), 0)) for o in other)  # seed and step are keys
    u = torch.cat(
        [RowDraws(1, "eval", (), ["q"] * 4000, list(range(4000))).at(torch.arange(4000), t) for t in range(25)]
    )
    assert u.min() >= 0 and u.max() < 1 and len(u.unique()) == len(u)
    counts = torch.histc(u.float(), bins=10, min=0, max=1)  # 100,000 draws, 10,000 expected per bin
    assert ((counts - 10_000).abs() < 5 * 95).all()  # within 5 standard errors (sd = sqrt(10,000 x 0.9))


def tiny():
    model, tok = TinyQwen2(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64).build(
        ALPHABET, 0
    )
    return model.eval(), tok


def test_a_rows_tokens_do_not_depend_on_which_rows_share_its_batch():
    """The same keyed rows sampled in a batch of 24, alone, in another order and beside other
    prompts (rows leaving the batch at different steps in each) give the same tokens."""
    model, tok = tiny()
    rows = [p for p in PROMPTS for _ in range(4)]
    keys = lambda seed: RowDraws(seed, "rollout", (1, 0), rows, [i % 4 for i in range(len(rows))])  # noqa: E731
    whole = generate(model, tok, rows, 16, 1.0, draws=keys(5))
    assert whole.completion_mask.sum(-1).unique().numel() > 2  # rows finished at different steps and left
    for pick in ([5], [23, 0, 11], list(range(23, -1, -1))):
        sub = [rows[i] for i in pick]
        index = [i % 4 for i in pick]
        got = generate(model, tok, sub, 16, 1.0, draws=RowDraws(5, "rollout", (1, 0), sub, index))
        for j, i in enumerate(pick):
            n = int(whole.completion_mask[i].sum())
            assert torch.equal(got.completion_ids[j, :n], whole.completion_ids[i, :n]), (pick, i)
    assert not torch.equal(
        generate(model, tok, rows, 16, 1.0, draws=keys(6)).completion_ids,
        whole.completion_ids,  # another seed
    )


def test_coupled_evaluation_samples_do_not_depend_on_the_batch_size():
    model, tok = tiny()
    engine = KVCache(model, tok)
    rows = [{"prompt": p, "answer": "0"} for p in PROMPTS]

    class Never:  # scores nothing right: the test compares tokens, through the answers' texts
        def score(self, rows, texts):
            return torch.zeros(len(texts))

    got = [
        sampled_answers(engine, tok, Never(), rows, 4, Sampling(b, 12, 1.0, 1.0, 3, None, True)).texts for b in (24, 5)
    ]
    assert got[0] == got[1]
    uncoupled = [sampled_answers(engine, tok, Never(), rows, 4, Sampling(b, 12, 1.0, 1.0, 3)).texts for b in (24, 5)]
    assert uncoupled[0] != uncoupled[1]  # torch's generator hands its draws out in batch order


def test_coupled_runs_at_one_seed_are_identical_and_two_arms_share_their_first_rollout(tmp_path, warm_cache):
    """A/A: the same coupled arm twice gives the same metrics. grpo and dr_grpo start from one
    policy, so their first step samples the same tokens (same rewards, lengths and tokens)."""
    common = ["rollout.coupled=true", "steps=3", "eval.every=0", "checkpoint.every=0"]
    for name, arm in (("a", "algo=grpo"), ("b", "algo=grpo"), ("c", "algo=dr_grpo")):
        run(make_cfg([*common, arm], cache_dir=warm_cache), str(tmp_path / name))
    a, b, c = (metrics(tmp_path / n) for n in "abc")
    assert a == b
    shared = ("train/gen_tokens", "train/reward", "train/completion_len", "train/len_correct")
    assert [a[1].get(k) for k in shared] == [c[1].get(k) for k in shared]
    assert a[1]["train/gen_tokens"] > 0

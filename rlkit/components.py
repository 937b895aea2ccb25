"""The component kinds: what a plugin implements, in one place.

Each kind is a `typing.Protocol` with its methods and declared attributes. Subclass it to
inherit the attribute defaults (a plugin that does not subclass must declare every attribute;
`check` names the missing ones). The training loop reads these attributes and never asks which
implementation it holds. A component is chosen by a YAML file in the kind's config group whose
`_target_` names the class (`_partial_: true` where run-time arguments arrive; they are listed
under each kind).
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from rlkit.types import Episodes, Generation, LossInput, Rollout


class AdvantageEstimator(Protocol):
    """Group `advantage`. `estimator(rollout, values=None)` returns per-token advantages
    `[N, Tc]`, or `(advantages, returns)` `[N, Tc]` each when it trains a critic. `values` are
    the critic's `[N, Tc]` when `needs_critic`."""

    min_group_size: int = 2  # rollout.group_size is checked against it before any model is built
    needs_critic: bool = False  # the core builds the `critic` component and passes its values
    needs_step_rewards: bool = False  # the core scores each reasoning step (rollout.step_rewards, step_mask)
    needs_policy_stats: bool = False  # the core puts the old policy's log-probs and sum pi^2 in rollout.policy_stats
    data_parallel: bool = True  # exact when each rank sees only its own groups (torchrun)

    def __call__(self, rollout: Rollout, values: torch.Tensor | None = None): ...


class Aggregator(Protocol):
    """Group `aggregator`: per-token loss weights, computed once over the optimizer-step batch, so
    the loss is `sum(L * weights)` and any micro-batch split gives the same gradient."""

    def token_weights(self, mask: torch.Tensor) -> torch.Tensor: ...  # [N, Tc] -> [N, Tc]


class Sampler(Protocol):
    """Group `sampler` (`_partial_: true`; `dataset`, `batch_size`, `seed` arrive at run time).
    `sample(make_rollout)` calls `make_rollout(rows)` (G completions per dataset row, scored) as
    often as it likes and returns the rollout to train on with its own metrics."""

    min_group_size: int = 1
    data_parallel: bool = True  # its choices can be made on each rank's share alone (torchrun)
    even_shares: bool = True  # every rank always trains on as many rows as the others (a sharded model needs it)

    def sample(self, make_rollout: Callable[[list[dict]], Rollout]) -> tuple[Rollout, dict]: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


class PolicyLoss(Protocol):
    """Group `loss`. `loss(x)` takes one micro-batch's `LossInput` (log-probs with gradient, old and
    reference log-probs, advantages, mask, entropy, the correction's weights, the selected tokens)
    and returns (per-token loss `[n, Tc]`, statistics `{name: [n, Tc]}`); the loop logs each
    statistic's token mean as `train/<name>` without knowing the names. `train_mask(rollout)` is
    the completion mask the aggregator normalises over (a loss may drop rows, e.g. truncated ones)."""

    beta: float = 0.0  # KL coefficient; 0 builds no reference model and runs no reference forward
    kl_in_reward: bool = False  # True: the core subtracts beta * KL from the per-token reward instead
    entropy_grad: bool = False  # True: the entropy passed in carries a gradient (an entropy bonus)
    selects_tokens: bool = False  # True: `token_selection` picks the tokens the policy term acts on

    def __call__(self, x: LossInput) -> tuple[torch.Tensor, dict]: ...
    def kl_penalty(self, old_logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor: ...  # [N, Tc]
    def train_mask(self, rollout: Rollout) -> torch.Tensor: ...  # [N, Tc]

    def token_selection(self, entropy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor | None:
        return None  # [N, Tc] from the rollout's entropies under the policy that generated it

    def end_step(self, entropy_sums: torch.Tensor) -> None:
        pass  # after each optimizer step: the entropy sum and token count [2] of its selected tokens

    def state_dict(self) -> dict:
        return {}  # what a checkpoint keeps (e.g. an adaptive coefficient)

    def load_state_dict(self, state: dict) -> None:
        pass


class Correction(Protocol):
    """Group `correction`: weights for a rollout the trainer did not sample (a stale or lower-
    precision engine). `correction(logp, old_logp, behaviour_logp, adv, mask)` -> (weights
    `[n, Tc]`, statistics `{name: [n, Tc]}`), without gradient; every `loss` multiplies its policy
    term by the weights. `behaviour_logp` is the engine's (the trainer's `old_logp` when the
    engine's numbers are the trainer's). `c_min`, `c_max`: the ratio band whose outside
    `offpolicy/outside_frac` reports (None: no upper bound)."""

    c_min: float = 0.5
    c_max: float | None = 2.0

    def __call__(
        self,
        logp: torch.Tensor,
        old_logp: torch.Tensor,
        behaviour_logp: torch.Tensor,
        adv: torch.Tensor,
        mask: torch.Tensor,
    ) -> tuple[torch.Tensor, dict]: ...


class Critic(Protocol):
    """Group `critic` (`_partial_: true`; `policy` and `max_grad_norm` arrive at run time). Built
    only when the estimator `needs_critic`."""

    def values(self, rollout: Rollout) -> torch.Tensor: ...  # [N, Tc], no gradient
    def fit(
        self, rollout: Rollout, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor
    ) -> float: ...  # one optimizer step on these rows; returns the value loss
    def save(self, path) -> None: ...
    def load(self, path) -> None: ...
    def state_dict(self) -> dict: ...  # optimizer state
    def load_state_dict(self, state: dict) -> None: ...


class Engine(Protocol):
    """Group `engine` (`_partial_: true`; `policy` and `tokenizer` arrive at run time): generation
    for training and evaluation. `exact_logprobs` says its sampling distribution is the trainer's
    own model, so old log-probs can be reused; otherwise the trainer recomputes them, and an engine
    that reports its own log-probs (`Generation.logprobs`) lets a `correction` weigh the loss.
    `load_weights(policy)` is called after every update; `latest()` is the engine held-out
    evaluation uses (the trainer's current weights); `state_dict()` is what a checkpoint keeps of
    it (weights that are not the policy's own, e.g. a lagging copy); `lag` the updates between the
    weights it samples with and the trainer's (None: it does not lag). An engine that runs
    multi-turn episodes says `multi_turn = True` (optional; absent: False): its `generate` then also
    takes `episodes` (one per prompt) and runs them turn by turn, `max_new_tokens` the budget of the
    whole trajectory, the environment's tokens included. An engine that takes `draws`
    (`rlkit.draws.RowDraws`: each row's uniform at each token position) samples with them instead of
    torch's generator; `rollout.coupled=true` needs it. An engine that takes `forced` (token ids and
    mask [N, Tf], right-padded) computes each such token's entropy teacher-forced after its prompt
    on the same prefill and returns it as `Generation.forced_entropy` (held-out evaluation's probe;
    without it the probe runs its own forward)."""

    exact_logprobs: bool = True
    lag: int | None = None

    def generate(
        self,
        prompts: list[str],
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        episodes: Episodes | None = None,
    ) -> Generation: ...
    def load_weights(self, policy: torch.nn.Module) -> None: ...

    def latest(self) -> "Engine":
        return self

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class Environment(Protocol):
    """Group `environment`: what answers the model between its turns. `start(row)` begins one
    episode for a task row: an object whose `reply(text)` takes the model's turn (decoded) and
    returns the chat message to append (`{"role": ..., "content": ...}`, rendered through the
    model's chat template), a list of them, or None to end the episode; its optional `cut(text)`
    hears that a budget ended the episode (`text`: the unfinished turn, "" if none). The reward is
    the task's, over the whole trajectory, plus the episode's `reward` attribute where it has one
    (the sum of the per-turn terms the environment gave, e.g. a penalty for a malformed call); an
    episode's `correct` attribute, where every one has it, is its verdict in place of the task's
    (the accuracy metrics). `max_turns` 1 is a single-turn task:
    the engine never asks. `metrics(episodes, correct)`: the environment's metrics of the episodes of
    one step or evaluation (`correct` [N])."""

    max_turns: int = 1
    stop_strings: tuple = ()  # strings that end a model turn besides the EOS token
    preamble: tuple = ()  # chat messages before every task prompt (a system prompt, an example call); () = none

    def start(self, row: dict): ...
    def metrics(self, episodes: list, correct: torch.Tensor) -> dict: ...


class Model(Protocol):
    """Group `model`: builds the policy and its tokenizer, the frozen reference (only when loss.beta
    > 0), loads checkpointed weights back, and formats a prompt for the model (e.g. a chat template)."""

    def build(self, alphabet: str, seed: int) -> tuple: ...  # (policy, tokenizer)
    def reference(self, policy: torch.nn.Module) -> torch.nn.Module: ...
    def load(self, policy: torch.nn.Module, path) -> None: ...
    def format_prompt(self, tokenizer, prompt: str) -> str: ...


class RewardFunction(Protocol):
    """One weighted term of a task's reward (`reward.functions.<name>`, e.g. from group `rewards`):
    `fn(row, completion, task) -> float`, logged as `reward/<name>`."""

    weight: float = 1.0

    def __call__(self, row: dict, completion: str, task) -> float: ...


class Task(Protocol):
    """Group `task`: the data and how a completion scores. `train` and `eval` are `datasets.Dataset`s
    with `prompt` and `answer` columns (a `difficulty` column gives per-level metrics). Subclass
    `rlkit.tasks.base.Task` for every method but `reward` (a lenient `present`, one outcome step,
    the character alphabet, the rows' digest, the split checks)."""

    train: object  # datasets.Dataset
    eval: object
    demonstrations: object | None = None  # the prompts the warm start demonstrates; None: every training prompt
    demonstration = None  # method (row, rng) -> a worked answer to train on; None: no warm start, no probe set
    features = None  # method completion -> {name: number}, logged per step; None: no feature metrics
    alphabet: str  # the characters of both splits (for a character tokenizer)
    digest: dict  # split -> SHA-256 of its rows, which a checkpoint records

    def reward(self, row: dict, completion: str) -> float: ...
    def present(self, row: dict, completion: str) -> bool: ...  # the answer anywhere (`eval/present`)
    def step_rewards(self, row: dict, completion: str) -> list[tuple[int, float]]: ...  # (end char, reward) per step
    def step_metrics(self) -> dict: ...  # what scoring this step gathered, read once per step
    def check_splits(self) -> None: ...  # raises TaskError naming an empty split or a missing column


class MetricSink(Protocol):
    """Group `logger` (`_partial_: true`; `run_dir`, `run_config`, `resume_step`, `run_id` and
    `run_info` arrive at run time): where each step's metrics and sample completions go. `run_id`
    names the sink's own run (a wandb run, continued on resume; None where there is none)."""

    run_id: str | None = None

    def log(self, step: int, metrics: dict) -> None: ...
    def log_samples(self, step: int, samples: list[dict]) -> None: ...
    def finish(self) -> None: ...

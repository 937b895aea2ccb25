"""Policy models and tokenizers: a tiny built-in Qwen2 with a character tokenizer, or any
Hugging Face causal LM by path or hub id."""
from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (AutoModelForCausalLM, AutoTokenizer, PreTrainedModel,
                          PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM)

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]


def char_tokenizer(alphabet: str) -> PreTrainedTokenizerFast:
    """One token per character of `alphabet`, plus pad/bos/eos/unk, as a transformers fast tokenizer."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS + sorted(set(alphabet)))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>",
                                   eos_token="<eos>", unk_token="<unk>", padding_side="left")


class TinyQwen2:
    """A Qwen2-architecture causal LM of about 1M parameters built from a config (no download),
    with a character tokenizer over the task's alphabet."""

    def __init__(self, hidden_size: int = 128, num_layers: int = 4, num_heads: int = 4,
                 num_kv_heads: int = 2, intermediate_size: int = 384, max_position_embeddings: int = 128):
        if min(hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, max_position_embeddings) < 1:
            raise ValueError("model sizes must all be >= 1")
        if hidden_size % num_heads or (hidden_size // num_heads) % 2 or num_heads % num_kv_heads:
            raise ValueError(f"model.hidden_size={hidden_size} must split into model.num_heads={num_heads} heads of "
                             f"even size, and num_heads must be a multiple of model.num_kv_heads={num_kv_heads}")
        self.kwargs = dict(hidden_size=hidden_size, num_hidden_layers=num_layers, num_attention_heads=num_heads,
                           num_key_value_heads=num_kv_heads, intermediate_size=intermediate_size,
                           max_position_embeddings=max_position_embeddings)

    def build(self, alphabet: str, seed: int) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
        tokenizer = char_tokenizer(alphabet)
        config = Qwen2Config(vocab_size=len(tokenizer), tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                             bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                             use_sliding_window=False, **self.kwargs)
        torch.manual_seed(seed)
        return Qwen2ForCausalLM(config), tokenizer


class Pretrained:
    """Any Hugging Face causal LM and its tokenizer, by local path or hub id."""

    def __init__(self, path: str, dtype: str = "float32"):
        self.path, self.dtype = path, dtype

    def build(self, alphabet: str, seed: int) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
        tokenizer = AutoTokenizer.from_pretrained(self.path)
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        model = AutoModelForCausalLM.from_pretrained(self.path, dtype=getattr(torch, self.dtype))
        return model, tokenizer

"""Multi-turn episodes in the decode loop (`rlkit.engines.kv_cache.generate` with `episodes`): a
model turn ends at EOS or at one of the environment's stop strings; the environment's reply,
rendered through the chat template, is queued and fed to the decoder token by token like any
sampled token, so the KV cache holds the whole trajectory and nothing is prefilled twice."""

from __future__ import annotations

import torch

from rlkit.types import Episodes


def reply_ids(tokenizer, message: dict | list, after_eos: bool) -> list[int]:
    """The tokens that follow a model turn when `message` (or a list of messages) is appended: the
    turn's end, the messages and the next assistant turn's start, as the chat template writes them (a
    tokenizer without one: the contents alone). A turn that ended with EOS already holds its
    end-of-turn token."""
    messages = message if isinstance(message, list) else [message]
    if getattr(tokenizer, "chat_template", None):
        mark = "\x1f\x1e"  # a stand-in for the model's turn, which the text after it follows
        chat = [{"role": "user", "content": "?"}, {"role": "assistant", "content": mark}, *messages]
        full = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        text = full[full.index(mark) + len(mark) :]
    else:
        text = "".join(m["content"] for m in messages)
    eos = tokenizer.eos_token or ""
    if after_eos and eos and text.startswith(eos):
        text = text[len(eos) :]
    return tokenizer(text, add_special_tokens=False)["input_ids"]


class Turns:
    """The decode loop's multi-turn state for N rows: each row's environment tokens still to feed,
    where its current model turn began, its turns so far, and which tokens the model wrote."""

    def __init__(self, tokenizer, episodes: Episodes, tokens: torch.Tensor):
        self.tokenizer, self.episodes, self.tokens = tokenizer, episodes, tokens  # tokens [N, Tmax], filled by the loop
        N, self.budget = tokens.shape
        self.model = torch.zeros_like(tokens)  # [N, Tmax] 1 on the model's tokens
        self.pending = [[] for _ in range(N)]  # environment tokens still to feed, per row
        self.start, self.turns = [0] * N, [0] * N  # where each row's model turn began; its finished turns
        self.ended = [False] * N  # episodes that ended themselves (their reply None)
        self.cut = torch.zeros(N, dtype=torch.bool, device=tokens.device)  # [N] ended by the turn or token budget
        stops = [len(tokenizer(s, add_special_tokens=False)["input_ids"]) for s in episodes.stop_strings]
        self.tail = max(stops) + 2 if stops else 0  # tokens decoded to find a stop string (it may split differently)

    def force(self, t: int, rows: torch.Tensor, tok: torch.Tensor, fin: torch.Tensor) -> torch.Tensor:
        """Step t's tokens [n]: the next environment token of each row that has one queued, else the
        sampled one (marked as the model's unless the row has finished)."""
        tok = tok.clone()
        for j, r in enumerate(rows.tolist()):
            if self.pending[r]:
                tok[j] = self.pending[r].pop(0)
            elif not fin[j]:
                self.model[r, t] = 1
        return tok

    def advance(self, t: int, rows: torch.Tensor, tok: torch.Tensor, fin: torch.Tensor, eos: int) -> torch.Tensor:
        """After step t: end the turns that ended (EOS or a stop string), ask their episodes, queue the
        replies. Returns which rows have finished [n]."""
        fin = fin.clone()
        for j, r in enumerate(rows.tolist()):
            if fin[j] or not self.model[r, t] or not self.turn_ended(r, t, int(tok[j]) == eos):
                continue
            fin[j] = self.end_turn(r, t, int(tok[j]) == eos)
        return fin

    def turn_ended(self, r: int, t: int, at_eos: bool) -> bool:
        if at_eos or not self.tail:
            return at_eos
        text = self.tokenizer.decode(self.tokens[r, max(self.start[r], t - self.tail) : t + 1])
        return any(s in text for s in self.episodes.stop_strings)

    def end_turn(self, r: int, t: int, at_eos: bool) -> bool:
        """Row r's model turn ended at step t: its episode's reply queued (True: the episode is over)."""
        self.turns[r] += 1
        turn = self.tokenizer.decode(self.tokens[r, self.start[r] : t + 1], skip_special_tokens=True)
        message = self.episodes.each[r].reply(turn)
        if message is None:
            self.ended[r] = True
            return True
        ids = reply_ids(self.tokenizer, message, at_eos)
        if self.turns[r] >= self.episodes.max_turns or t + 1 + len(ids) >= self.budget:
            self.cut[r], self.start[r] = True, t + 1  # the reply and a turn after it no longer fit
            return True
        self.pending[r], self.start[r] = ids, t + 1 + len(ids)
        return False

    def close(self, T: int) -> None:
        """After the last of T steps: each episode that did not end itself (the turn or token budget
        cut it) told so where it listens (`cut(text)`, optional), with the model's unfinished turn
        (decoded; "" when its last turn had ended)."""
        for r, episode in enumerate(self.episodes.each):
            if not self.ended[r] and hasattr(episode, "cut"):
                own = self.model[r, self.start[r] : T].bool()  # [t] the model's tokens of its unfinished turn
                episode.cut(self.tokenizer.decode(self.tokens[r, self.start[r] : T][own], skip_special_tokens=True))

"""Tokenizer loading and incremental detokenization with stop strings."""

from __future__ import annotations

import functools
from pathlib import Path

from workers.model_config import CheckpointError


def load_tokenizer(path: str):
    """The checkpoint's fast tokenizer (tokenizer.json + tokenizer_config.json, chat template included)."""
    if not (Path(path) / "tokenizer.json").is_file() and not (Path(path) / "tokenizer_config.json").is_file():
        raise CheckpointError(f"{path!r} has no tokenizer.json / tokenizer_config.json")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


class ChatTemplateError(ValueError):
    """The model's chat template refused the messages (e.g. a role it does not support)."""


def chat_prompt_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """The token ids of a chat prompt: the template rendered to text, then encoded WITHOUT the tokenizer's own
    special tokens. Templates add what they need (Llama 3's starts with ``{{ bos_token }}`` while its tokenizer also
    prepends BOS, so encoding with special tokens would start the prompt with two), as vLLM does by default.
    Raises ChatTemplateError when the template rejects the messages."""
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as e:  # noqa: BLE001 - jinja's TemplateError (raise_exception) or a template's own bug
        raise ChatTemplateError(f"the chat template rejected the messages: {e}") from e
    return tokenizer.encode(text, add_special_tokens=False)


class Detokenizer:
    """Turns a growing list of token ids into text deltas in O(new tokens) per step: only a short window of ids is
    decoded again (the tokens read last step give the new ones context, so a byte-level token boundary or an
    incomplete UTF-8 sequence resolves), and only the text not yet emitted is searched for stop strings. Text that
    could be the start of a stop string is held back until decided; a matched stop string ends the text before it.

    Nothing emitted can contain the start of a match: the longest suffix of the text that begins a stop string is
    always held back, so a later match starts in the held-back text or after it."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        # the fast tokenizer's own decoder, without transformers' per-call wrapping (half of a step's host time at
        # 96 requests); transformers' decode adds only the clean-up of spaces, which this tokenizer does not ask for
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
            self._decode = functools.partial(backend.decode, skip_special_tokens=True)
        self.stop = [s for s in stop if s]
        self._window: list[int] = []  # the ids decoding restarts from: last step's read tokens, then the unread
        self._read = 0  # window[:_read] is decoded text already; window[_read:] is not yet
        self._unsent = ""  # decoded but not emitted (held back: it may begin a stop string)
        self._sent: list[str] = []  # the emitted deltas

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._sent)

    def _held_back(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        hold = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:k]):
                    hold = k
                    break
        return hold

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, new_ids: list[int], final: bool) -> tuple[str, bool]:
        """Add tokens; returns (new text, whether a stop string was hit)."""
        window = self._window
        window.extend(new_ids)
        before = self._decode(window[: self._read]) if self._read else ""
        after = self._decode(window)
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            self._unsent += after[len(before):]
            self._window = window[self._read:]  # the tokens read now are the next window's context
            self._read = len(self._window)
        unsent, hit = self._unsent, False
        if self.stop:
            hits = [i for i in (unsent.find(s) for s in self.stop) if i >= 0]
            if hits:
                unsent, hit, final = unsent[: min(hits)], True, True
        delta = unsent if final else unsent[: len(unsent) - self._held_back(unsent)] if self.stop else unsent
        self._unsent = unsent[len(delta):]
        if delta:
            self._sent.append(delta)
        return delta, hit

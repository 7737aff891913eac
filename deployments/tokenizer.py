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
    """Turns a growing list of token ids into text deltas in O(new tokens) per step: only a short window of ids
    (from ``prefix_offset``) is decoded again, so a byte-level token boundary or an incomplete UTF-8 sequence
    resolves with context. Text that could be the start of a stop string is held back until decided; a matched
    stop string ends the text before it."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        # the fast tokenizer's own decoder, without transformers' per-call wrapping (half of a step's host time at
        # 96 requests); transformers' decode adds only the clean-up of spaces, which this tokenizer does not ask for
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
            self._decode = functools.partial(backend.decode, skip_special_tokens=True)
        self.stop = [s for s in stop if s]
        self.max_stop = max((len(s) for s in self.stop), default=0)
        self.ids: list[int] = []
        self.decoded = ""  # text of ids[:read_offset]
        self.prefix_offset = 0  # decoding restarts here: the tokens read last step give the new ones context
        self.read_offset = 0
        self.text = ""  # what has been emitted so far

    def _held_back(self, full: str) -> int:
        hold = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(full)), 0, -1):
                if full.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        return hold

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, new_ids: list[int], final: bool) -> tuple[str, bool]:
        """Add tokens; returns (new text, whether a stop string was hit)."""
        searched_from = max(0, len(self.decoded) - self.max_stop)
        self.ids.extend(new_ids)
        before = self._decode(self.ids[self.prefix_offset : self.read_offset])
        after = self._decode(self.ids[self.prefix_offset :])
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            self.decoded += after[len(before):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
        full = self.decoded
        hit = False
        hits = [i for i in (full.find(s, searched_from) for s in self.stop) if i >= 0]
        if hits:
            full, hit, final = full[: min(hits)], True, True
        safe = full if final else full[: len(full) - self._held_back(full)]
        delta = safe[len(self.text):] if safe.startswith(self.text) else safe
        self.text = safe
        return delta, hit

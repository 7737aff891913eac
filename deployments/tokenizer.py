"""Tokenizer loading and incremental detokenization with stop strings."""

from __future__ import annotations

from pathlib import Path

from workers.model_config import CheckpointError


def load_tokenizer(path: str):
    """The checkpoint's fast tokenizer (tokenizer.json + tokenizer_config.json, chat template included)."""
    if not (Path(path) / "tokenizer.json").is_file() and not (Path(path) / "tokenizer_config.json").is_file():
        raise CheckpointError(f"{path!r} has no tokenizer.json / tokenizer_config.json")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


class Detokenizer:
    """Turns a growing list of token ids into text deltas. Text that could be the start of a stop string, or an
    incomplete UTF-8 sequence, is held back until it is decided; a matched stop string ends the text before it."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.ids: list[int] = []
        self.text = ""  # what has been emitted so far

    def _held_back(self, full: str) -> int:
        hold = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(full)), 0, -1):
                if full.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        if full.endswith("\ufffd"):
            hold = max(hold, 1)
        return hold

    def push(self, new_ids: list[int], final: bool) -> tuple[str, bool]:
        """Add tokens; returns (new text, whether a stop string was hit)."""
        self.ids.extend(new_ids)
        full = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        hit = False
        hits = [i for i in (full.find(s) for s in self.stop) if i >= 0]
        if hits:
            full, hit, final = full[: min(hits)], True, True
        safe = full if final else full[: len(full) - self._held_back(full)]
        common = len(self.text) if safe.startswith(self.text) else 0
        delta = safe[common:]
        self.text = safe
        return delta, hit

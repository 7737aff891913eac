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


def _fast_backend(tokenizer):
    """The fast tokenizer's own (Rust) tokenizer where it decodes as ``tokenizer.decode`` does, else None: a slow
    tokenizer, or one that asks for transformers' clean-up of spaces (the only thing transformers' decode adds)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    return backend


def _decode_stream_factory(tokenizer):
    """A maker of ``tokenizers.decoders.DecodeStream`` over ``_fast_backend``, or None where there is none or the
    installed tokenizers predates it."""
    backend = _fast_backend(tokenizer)
    if backend is None:
        return None
    try:
        from tokenizers.decoders import DecodeStream
    except ImportError:
        return None
    return backend, functools.partial(DecodeStream, skip_special_tokens=True)


class Detokenizer:
    """Turns a growing list of token ids into text deltas in O(new tokens) per step, and finds stop strings. Only
    the text not yet emitted is searched for stop strings. Text that could be the start of a stop string is held back
    until decided; a matched stop string ends the text before it.

    New text comes from the tokenizers library's ``DecodeStream`` (one call per token into Rust, which keeps the few
    ids a byte-level token boundary or an incomplete UTF-8 sequence needs). Where that does not decode as
    ``tokenizer.decode`` does, a short window of ids is decoded again each step instead (the tokens read last step
    give the new ones context). At the end, ids that never completed a character are decoded as ``decode`` would,
    with replacement characters, so the deltas always add up to the full decode.

    Nothing emitted can contain the start of a match: the longest suffix of the text that begins a stop string is
    always held back, so a later match starts in the held-back text or after it."""

    FLUSH_CONTEXT = 8  # ids decoded before the pending ones when a stream's incomplete tail is flushed

    def __init__(self, tokenizer, stop: list[str], stream: bool = True, min_tokens: int = 0):
        self.tokenizer = tokenizer
        # (vLLM's rule) stop strings are looked for only once the output has more than min_tokens tokens
        self.min_tokens, self._count = min_tokens, 0
        factory = _decode_stream_factory(tokenizer) if stream else None
        if factory is not None:
            self._backend, make_stream = factory
            self._stream = make_stream()
            self._ids: list[int] = []  # every id pushed (the final flush decodes the last few again)
            self._pending = 0  # trailing ids the stream has not turned into text yet
        else:
            self._stream = None
            # the fast tokenizer's own decoder, without transformers' per-call wrapping (paid per request per step)
            backend = _fast_backend(tokenizer)
            if backend is not None:
                self._decode = functools.partial(backend.decode, skip_special_tokens=True)
            self._window: list[int] = []  # the ids decoding restarts from: last step's read tokens, then the unread
            self._read = 0  # window[:_read] is decoded text already; window[_read:] is not yet
        self.stop = [s for s in stop if s]
        self.matched: str | None = None  # the stop string that ended the text (vLLM's stop_reason)
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
            # candidate suffixes start where the stop string's first character is (longest first): one C-level
            # comparison each, instead of one slice and comparison per length
            tail = text[len(text) - min(len(s) - 1, len(text)):]
            i = tail.find(s[0])
            while 0 <= i and len(tail) - i > hold:
                if s.startswith(tail[i:]):
                    hold = len(tail) - i
                    break
                i = tail.find(s[0], i + 1)
        return hold

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _stream_text(self, new_ids: list[int], final: bool) -> str:
        step, backend, pending = self._stream.step, self._backend, self._pending
        chunks = []
        for i in new_ids:
            chunk = step(backend, i)
            if chunk is None:
                pending += 1
            else:
                chunks.append(chunk)
                pending = 0
        self._ids += new_ids
        if final and pending:  # the ids of an unfinished character: decode them as the full decode would
            ctx = self._ids[-(pending + self.FLUSH_CONTEXT):]
            before, after = self._decode(ctx[:-pending]), self._decode(ctx)
            chunks.append(after[len(before):])
            pending = 0
        self._pending = pending
        return "".join(chunks)

    def _window_text(self, new_ids: list[int], final: bool) -> str:
        window = self._window
        window.extend(new_ids)
        before = self._decode(window[: self._read]) if self._read else ""
        after = self._decode(window)
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            self._window = window[self._read:]  # the tokens read now are the next window's context
            self._read = len(self._window)
            return after[len(before):]
        return ""

    def push(self, new_ids: list[int], final: bool) -> tuple[str, bool]:
        """Add tokens; returns (new text, whether a stop string was hit)."""
        new_text = self._stream_text(new_ids, final) if self._stream is not None else self._window_text(new_ids, final)
        unsent, hit = self._unsent + new_text if new_text else self._unsent, False
        self._count += len(new_ids)
        if self.stop and self._count > self.min_tokens:
            hits = [(i, s) for i, s in ((unsent.find(s), s) for s in self.stop) if i >= 0]
            if hits:
                at, self.matched = min(hits)
                unsent, hit, final = unsent[:at], True, True
        delta = unsent if final else unsent[: len(unsent) - self._held_back(unsent)] if self.stop else unsent
        self._unsent = unsent[len(delta):]
        if delta:
            self._sent.append(delta)
        return delta, hit


def detokenize_run(detok: Detokenizer, new_ids: list[int], final: bool,
                   stop_token: bool = False) -> tuple[str, bool, int]:
    """(new text, whether a stop string was hit, how many of ``new_ids`` are output). With stop strings, a run of
    several tokens (a speculative round's) goes in one token at a time: the tokens after the one that completes a
    stop string are not output, as they never would have been without speculation. ``stop_token``: the run's last
    token ended the request (EOS, a stop token id, the grammar's end): it counts, but its text is not output (vLLM)."""
    if stop_token and new_ids:
        text, hit, used = detokenize_run(detok, new_ids[:-1], final)
        return text, hit, used if hit else len(new_ids)
    if not detok.stop or len(new_ids) < 2:
        text, hit = detok.push(new_ids, final=final)
        return text, hit, len(new_ids)
    pieces = []
    for k, tok in enumerate(new_ids, start=1):
        text, hit = detok.push([tok], final=final and k == len(new_ids))
        pieces.append(text)
        if hit:
            return "".join(pieces), True, k
    return "".join(pieces), False, len(new_ids)

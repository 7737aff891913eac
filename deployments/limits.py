"""The per-request limits of ``LLMConfig`` (prompt characters, choices, stop strings), checked by the ingress before
anything costly: a prompt's characters are counted before it is tokenized or a chat template rendered. Each refusal
is a 400 naming the parameter, with OpenAI's code for it."""

from __future__ import annotations

from dataclasses import dataclass

from deployments.protocol import APIError, SamplingFields

# the default prompt limit: characters per token of the context length. Real text averages 3-5 characters per token
# (code and prose alike), so a longer prompt cannot fit the context; it is refused before a tokenizer spends seconds
# on it (about 0.7 s per MiB of text on one CPU core)
CHARS_PER_CONTEXT_TOKEN = 16


@dataclass(frozen=True)
class RequestLimits:
    """The values of LLMConfig's fields of the same names (their descriptions say what each is)."""

    max_prompt_chars: int | None  # None: CHARS_PER_CONTEXT_TOKEN × the context length
    max_n: int
    max_stop_strings: int
    max_stop_string_chars: int

    def prompt_chars(self, max_model_len: int) -> int:
        return self.max_prompt_chars or CHARS_PER_CONTEXT_TOKEN * max_model_len

    def check_fields(self, body: SamplingFields) -> None:
        """``n`` and the stop strings / stop token ids."""
        if body.n is not None and body.n > self.max_n:
            raise APIError(400, f"n: at most {self.max_n} choices per request (max_n), got {body.n}", param="n",
                           code="integer_above_max_value")
        stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
        if len(stop) > self.max_stop_strings:
            raise APIError(400, f"stop: at most {self.max_stop_strings} stop strings (max_stop_strings), got "
                           f"{len(stop)}", param="stop", code="array_above_max_length")
        longest = max(map(len, stop), default=0)
        if longest > self.max_stop_string_chars:
            raise APIError(400, f"stop: a stop string may have at most {self.max_stop_string_chars} characters "
                           f"(max_stop_string_chars), got {longest}", param="stop", code="string_above_max_length")
        ids = body.stop_token_ids or []
        if len(ids) > self.max_stop_strings:
            raise APIError(400, f"stop_token_ids: at most {self.max_stop_strings} ids (max_stop_strings), got "
                           f"{len(ids)}", param="stop_token_ids", code="array_above_max_length")

    def check_prompt(self, prompt: str | list[int], max_model_len: int) -> None:
        """A completion's prompt: text by its characters, token ids by their count (a list longer than the context
        is refused before it travels to the engine)."""
        if isinstance(prompt, str):
            self._check_chars(len(prompt), max_model_len, "prompt", "the prompt")
        elif len(prompt) >= max_model_len:
            raise APIError(400, f"this model's maximum context length is {max_model_len} tokens; the prompt has "
                           f"{len(prompt)} tokens", param="prompt", code="context_length_exceeded")

    def check_messages(self, messages: list[dict], max_model_len: int) -> None:
        """A chat's messages: every content's characters and every role's (the template writes each message's role:
        many empty messages still make a long prompt), before the template runs."""
        chars = sum(len(m["content"]) + len(m["role"]) for m in messages)
        self._check_chars(chars, max_model_len, "messages", "the messages' contents and roles")

    def _check_chars(self, chars: int, max_model_len: int, param: str, what: str) -> None:
        limit = self.prompt_chars(max_model_len)
        if chars > limit:
            source = "max_prompt_chars" if self.max_prompt_chars else (
                f"max_prompt_chars, by default {CHARS_PER_CONTEXT_TOKEN} per token of the {max_model_len}-token "
                "context")
            raise APIError(400, f"{what} may have at most {limit} characters ({source}), got {chars}", param=param,
                           code="string_above_max_length")

"""The OpenAI completions request, parsed and checked, and the JSON bodies the server answers with.

Follows the OpenAI ``POST /v1/completions`` schema and vLLM's extensions to it
(``stop_token_ids``, ``ignore_eos``, ``return_token_ids``). Fields outside that schema are ignored,
as vLLM does; fields of the schema that this engine does not implement are rejected when they ask
for something other than their default (``n``, ``best_of``, ``echo``, ``logprobs``, ``suffix``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from launch.engine.request import MAX_SEED, MIN_SEED, SamplingParams

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_STOP_STRINGS = 4


class ProtocolError(ValueError):
    """A request the server rejects; ``status`` is the HTTP status, ``param`` the offending field."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.status = status


@dataclass(frozen=True, slots=True, kw_only=True)
class CompletionRequest:
    """One validated completion request; ``prompt`` is a string or a list of token ids."""

    prompt: str | list[int]
    max_tokens: int
    temperature: float
    seed: int | None
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    stream: bool
    return_token_ids: bool

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            seed=self.seed,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
        )


def _short(value) -> str:
    """repr of ``value`` cut to 80 characters (a number of thousands of digits, or a deeply nested
    list, stays one readable line)."""
    if _is_int(value) and abs(value) >= 10**40:
        return f"an integer of {len(str(abs(value)))} digits"
    try:
        text = repr(value)
    except (ValueError, RecursionError):  # an int past Python's digit limit, deep nesting
        return f"a {type(value).__name__}"
    return text if len(text) <= 80 else text[:77] + "..."


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _get(body: dict, name: str, kinds: tuple[type, ...], default, what: str):
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise ProtocolError(f"'{name}' must be {what}, got {_short(value)}", param=name)
    return value


def _is_token_list(value) -> bool:
    return isinstance(value, list) and all(_is_int(t) for t in value)


def _parse_prompt(original) -> str | list[int]:
    prompt = original
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(_is_int(t) for t in prompt):
        return list(prompt)
    if (
        isinstance(prompt, list)
        and len(prompt) > 1
        and all(isinstance(p, str) or _is_token_list(p) for p in prompt)
    ):
        raise ProtocolError(
            f"a batch of {len(prompt)} prompts is not supported; send one prompt per request",
            param="prompt",
        )
    raise ProtocolError(
        "'prompt' must be a string or a list of token ids (ints), got " + _short(original),
        param="prompt",
    )


def parse_completion_request(body, *, model_name: str) -> CompletionRequest:
    """Check a decoded JSON body against the completions schema.

    Raises:
        ProtocolError: naming the field and the accepted values (HTTP 400), or an unknown
            ``model`` (HTTP 404, as OpenAI answers).
    """
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    if "prompt" not in body:
        raise ProtocolError("'prompt' is required", param="prompt")
    model = body.get("model")
    if model is not None and model != model_name:
        raise ProtocolError(
            f"The model `{model}` does not exist; this server serves `{model_name}`",
            param="model",
            status=404,
        )
    for name, default in (("n", 1), ("best_of", 1), ("echo", False), ("logprobs", None)):
        if body.get(name, default) not in (default, None):
            raise ProtocolError(f"'{name}' = {_short(body[name])} is not supported", param=name)
    if body.get("suffix"):
        raise ProtocolError("'suffix' is not supported", param="suffix")
    max_tokens = _get(body, "max_tokens", (int,), DEFAULT_MAX_TOKENS, "an integer >= 1")
    if max_tokens < 1:
        raise ProtocolError(
            f"'max_tokens' must be >= 1, got {_short(max_tokens)}", param="max_tokens"
        )
    temperature = _get(body, "temperature", (int, float), 1.0, "a number in [0, 2]")
    try:
        temperature = float(temperature)  # an int of thousands of digits overflows a float
    except OverflowError:
        temperature = math.inf
    if not 0.0 <= temperature <= 2.0:  # also refuses NaN and inf (Python's json reads both)
        raise ProtocolError(
            f"'temperature' must be in [0, 2], got {temperature}", param="temperature"
        )
    stop = _get(body, "stop", (str, list), [], "a string or a list of up to 4 strings")
    stop = [stop] if isinstance(stop, str) else stop
    if len(stop) > MAX_STOP_STRINGS or not all(isinstance(s, str) and s for s in stop):
        raise ProtocolError(
            f"'stop' must be a non-empty string or a list of up to {MAX_STOP_STRINGS} of them, "
            f"got {_short(stop)}",
            param="stop",
        )
    stop_token_ids = _get(body, "stop_token_ids", (list,), [], "a list of token ids")
    if not all(_is_int(t) for t in stop_token_ids):
        raise ProtocolError("'stop_token_ids' must be a list of ints", param="stop_token_ids")
    return CompletionRequest(
        prompt=_parse_prompt(body["prompt"]),
        max_tokens=max_tokens,
        temperature=temperature,
        seed=_parse_seed(body),
        stop=tuple(stop),
        stop_token_ids=tuple(stop_token_ids),
        ignore_eos=_get(body, "ignore_eos", (bool,), False, "a boolean"),
        stream=_get(body, "stream", (bool,), False, "a boolean"),
        return_token_ids=_get(body, "return_token_ids", (bool,), False, "a boolean"),
    )


def _parse_seed(body: dict) -> int | None:
    """vLLM's bound: torch.iinfo(torch.long), which torch.Generator.manual_seed accepts."""
    seed = _get(body, "seed", (int,), None, "an integer")
    if seed is not None and not MIN_SEED <= seed <= MAX_SEED:
        raise ProtocolError(
            f"'seed' must be in [-2**63, 2**63 - 1] (a 64-bit signed int), got {_short(seed)}",
            param="seed",
        )
    return seed


def check_prompt_ids(
    prompt_token_ids: list[int], *, max_tokens: int, vocab_size: int, max_model_len: int
) -> None:
    """Raise ProtocolError (400) if the prompt is empty, has an id outside the vocabulary, or
    does not leave room for ``max_tokens`` within ``max_model_len`` (vLLM's message)."""
    if not prompt_token_ids:
        raise ProtocolError("the prompt is empty", param="prompt")
    bad = next((t for t in prompt_token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ProtocolError(f"token id {_short(bad)} is outside [0, {vocab_size})", param="prompt")
    num_prompt = len(prompt_token_ids)
    if max_tokens > max_model_len:
        raise ProtocolError(
            f"'max_tokens' {_short(max_tokens)} exceeds this model's maximum context length "
            f"({max_model_len} tokens)",
            param="max_tokens",
        )
    if num_prompt + max_tokens > max_model_len:
        raise ProtocolError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {_short(num_prompt + max_tokens)} tokens ({num_prompt} in the prompt, "
            f"{_short(max_tokens)} in the completion). Please reduce the prompt or max_tokens.",
            param="prompt" if num_prompt >= max_model_len else "max_tokens",
        )


def error_body(message: str, *, status: int, param: str | None = None) -> dict:
    """OpenAI's error object."""
    kinds = {503: "service_unavailable"}
    kind = "invalid_request_error" if 400 <= status < 500 else kinds.get(status, "server_error")
    return {
        "error": {
            "message": message,
            "type": kind,
            "param": param,
            "code": status,
        }
    }


def completion_body(
    *,
    request_id: str,
    model: str,
    text: str,
    token_ids: list[int] | None,
    finish_reason: str | None,
    usage: dict | None,
    created: int | None = None,
) -> dict:
    """A ``text_completion`` object (a whole response, or one streamed chunk) with one choice."""
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    body = {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()) if created is None else created,
        "model": model,
        "choices": [choice],
    }
    if usage is not None:
        body["usage"] = usage
    return body

"""The OpenAI completions request, parsed and checked, and the JSON bodies the server answers with.

Follows the OpenAI ``POST /v1/completions`` schema and vLLM's extensions to it
(``stop_token_ids``, ``ignore_eos``, ``return_token_ids``). Fields outside that schema are ignored,
as vLLM does; fields of the schema that this engine does not implement are rejected when they ask
for something other than their default (``best_of`` > n, ``suffix``, ``echo`` with ``logprobs``).
The sampling fields are shared with chat completions (``launch.serving.chat_protocol``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from launch.engine.request import MAX_SEED, MIN_SEED, SamplingParams, offset_seed
from launch.engine.sampler import MAX_LOGPROBS

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_STOP_STRINGS = 4


class ProtocolError(ValueError):
    """A request the server rejects: ``status`` the HTTP status, ``param`` the offending field."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.status = status


class ServerBusy(ProtocolError):
    """The server cannot take this request now (503 with ``Retry-After``): its queue is full, or
    the engine loop is stuck."""

    def __init__(self, message: str) -> None:
        super().__init__(message, status=503)


# Sampling fields of OpenAI / vLLM this engine does not implement: refused unless at their
# neutral value, so that a client never gets silently different sampling.
UNSUPPORTED_SAMPLING = {
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "repetition_penalty": (1,),
    "logit_bias": ({},),
    "top_k": (-1, 0),
    "min_p": (0,),
}
MAX_N = 64  # choices per request (n x prompts), a guard against one request flooding a rank


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingOptions:
    """The sampling fields shared by completions and chat completions, checked.

    ``max_tokens`` None (chat without a limit) means: up to the context length.
    """

    max_tokens: int | None
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    n: int
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage

    def sampling_params(
        self, *, index: int, max_tokens: int, logprobs: int | None
    ) -> SamplingParams:
        """The engine's parameters for choice ``index`` (of ``n``); with a ``seed``, choice i is
        seeded ``seed + i`` so that the n choices differ yet each is reproducible."""
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            # seed + index wrapped into the 64-bit signed range (seed 2**63 - 1 with n > 1)
            seed=None if self.seed is None else offset_seed(self.seed, index),
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class CompletionRequest:
    """One validated completion request: one or more prompts (strings or token-id tuples)."""

    prompts: tuple[str | tuple[int, ...], ...]
    options: SamplingOptions
    logprobs: int | None  # top logprobs per token (0: the sampled token's only)
    echo: bool
    return_token_ids: bool


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _get(body: dict, name: str, kinds: tuple[type, ...], default, what: str):
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise ProtocolError(f"'{name}' must be {what}, got {_short(value)}", param=name)
    return value


def _get_int(body: dict, name: str, default, low: int, high: int):
    value = _get(body, name, (int,), default, f"an integer in [{low}, {high}]")
    if value is not None and not low <= value <= high:
        raise ProtocolError(f"'{name}' must be in [{low}, {high}], got {value}", param=name)
    return value


# A long list is scanned in slices of this many items, each one C call: a large body is checked
# on an executor thread (``http_errors.LARGE_BODY_BYTES``), and the event loop's thread waits for
# the GIL while such a call runs (about 1 ms per slice).
SCAN_SLICE = 1 << 15


def _types_in(values: list) -> set[type]:
    """The types of the items of ``values``, at C speed (a 1 MiB list of token ids in ~10 ms)."""
    kinds: set[type] = set()
    for start in range(0, len(values), SCAN_SLICE):
        kinds.update(map(type, values[start : start + SCAN_SLICE]))
    return kinds


def _all_of_type(values: list, kind: type) -> bool:
    """Whether every item of ``values`` is exactly a ``kind`` (not a subclass: ``True`` is no
    int)."""
    return _types_in(values) <= {kind}


def _parse_prompts(prompt) -> tuple[str | tuple[int, ...], ...]:
    """OpenAI's four prompt forms: a string, a list of strings, a list of token ids, or a list of
    token-id lists."""
    if isinstance(prompt, str):
        return (prompt,)
    if isinstance(prompt, list) and prompt and _all_of_type(prompt, int):
        return (tuple(prompt),)
    if isinstance(prompt, list) and prompt and _all_of_type(prompt, str):
        return tuple(prompt)
    if (
        isinstance(prompt, list)
        and prompt
        and _all_of_type(prompt, list)
        and all(_all_of_type(p, int) for p in prompt)
    ):
        return tuple(tuple(p) for p in prompt)
    if prompt == []:
        return ((),)  # refused as "the prompt is empty" by check_prompt_ids
    raise ProtocolError(
        "'prompt' must be a string, a list of strings, a list of token ids (ints) or a list of "
        "token-id lists, got " + _short(prompt),
        param="prompt",
    )


def _lone_surrogate(text: str) -> int | None:
    """Index of the first lone UTF-16 surrogate in ``text`` (JSON's ``"\\ud800"``), or None."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


def _field_path(path: tuple) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")


# What JSON decodes to besides str, list and dict: nothing in it can hold text.
_SCALARS = frozenset({int, float, bool, type(None)})


def check_text_fields(body) -> None:
    """Refuse a body holding a string (or object key) that is not valid Unicode text: a lone
    UTF-16 surrogate, which Python's json accepts (``"\\ud800"``) but no tokenizer or UTF-8
    writer can take. Walks the decoded JSON without recursion (any depth json accepted); a list
    of numbers (token ids) is skipped at C speed, so the walk costs little more than json.loads.

    Raises:
        ProtocolError (400): naming the field path (``messages[0].content``) and the index;
            ``param`` is the top-level field.
    """
    stack: list[tuple[tuple, object]] = [((), body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                if isinstance(key, str) and (index := _lone_surrogate(key)) is not None:
                    _refuse_surrogate(path, f"a key ({key[:40]!r})", index)
                stack.append(((*path, key), item))
        elif isinstance(value, list):
            if not _types_in(value) <= _SCALARS:
                stack.extend(
                    ((*path, i), item) for i, item in enumerate(value) if type(item) not in _SCALARS
                )
        elif isinstance(value, str) and (index := _lone_surrogate(value)) is not None:
            _refuse_surrogate(path, "the text", index)


def _refuse_surrogate(path: tuple, what: str, index: int) -> None:
    where = f"'{_field_path(path)}'" if path else "the request body"
    param = path[0] if path and isinstance(path[0], str) else None
    raise ProtocolError(
        f"{where}: {what} holds a lone UTF-16 surrogate at index {index}; text must be valid "
        "Unicode (encode a character outside the BMP as a surrogate pair)",
        param=param,
    )


def check_model(body: dict, model_name: str) -> None:
    """Raise ProtocolError (404, as OpenAI answers) if ``model`` names another model."""
    model = body.get("model")
    if model is not None and model != model_name:
        raise ProtocolError(
            f"The model `{model}` does not exist; this server serves `{model_name}`",
            param="model",
            status=404,
        )


def _to_float(value) -> float:
    try:
        return float(value)
    except OverflowError:  # an int of hundreds of digits
        return math.inf


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


def _parse_seed(body: dict) -> int | None:
    """vLLM's bound: torch.iinfo(torch.long), which torch.Generator.manual_seed accepts."""
    seed = _get(body, "seed", (int,), None, "an integer")
    if seed is not None and not MIN_SEED <= seed <= MAX_SEED:
        raise ProtocolError(
            f"'seed' must be in [-2**63, 2**63 - 1] (a 64-bit signed int), got {_short(seed)}",
            param="seed",
        )
    return seed


def parse_sampling_options(
    body: dict, *, default_max_tokens: int | None, max_tokens_names: tuple[str, ...]
) -> SamplingOptions:
    """The sampling fields of a completions or chat body (the first of ``max_tokens_names`` that
    is set gives ``max_tokens``). Raises ProtocolError naming the field and the accepted values."""
    for name, neutral in UNSUPPORTED_SAMPLING.items():
        if body.get(name) is not None and body[name] not in neutral:
            raise ProtocolError(
                f"'{name}' = {body[name]!r} is not supported (only {neutral[0]!r})", param=name
            )
    name = next((n for n in max_tokens_names if body.get(n) is not None), max_tokens_names[0])
    max_tokens = _get(body, name, (int,), default_max_tokens, "an integer >= 1")
    if max_tokens is not None and max_tokens < 1:
        raise ProtocolError(f"'{name}' must be >= 1, got {_short(max_tokens)}", param=name)
    temperature = _to_float(_get(body, "temperature", (int, float), 1.0, "a number in [0, 2]"))
    if not 0.0 <= temperature <= 2.0:  # also refuses NaN and inf (Python's json reads both)
        raise ProtocolError(
            f"'temperature' must be in [0, 2], got {temperature}", param="temperature"
        )
    top_p = _to_float(_get(body, "top_p", (int, float), 1.0, "a number in (0, 1]"))
    if not 0.0 < top_p <= 1.0:
        raise ProtocolError(f"'top_p' must be in (0, 1], got {top_p}", param="top_p")
    stop = _get(body, "stop", (str, list), [], "a string or a list of up to 4 strings")
    stop = [stop] if isinstance(stop, str) else stop
    if len(stop) > MAX_STOP_STRINGS or not all(isinstance(s, str) and s for s in stop):
        raise ProtocolError(
            f"'stop' must be a non-empty string or a list of up to {MAX_STOP_STRINGS} of them, "
            f"got {_short(stop)}",
            param="stop",
        )
    stop_token_ids = _get(body, "stop_token_ids", (list,), [], "a list of token ids")
    if not _all_of_type(stop_token_ids, int):
        raise ProtocolError("'stop_token_ids' must be a list of ints", param="stop_token_ids")
    stream_options = _get(body, "stream_options", (dict,), {}, "an object")
    return SamplingOptions(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=_parse_seed(body),
        stop=tuple(stop),
        stop_token_ids=tuple(stop_token_ids),
        ignore_eos=_get(body, "ignore_eos", (bool,), False, "a boolean"),
        n=_get_int(body, "n", 1, 1, MAX_N),
        stream=_get(body, "stream", (bool,), False, "a boolean"),
        include_usage=bool(stream_options.get("include_usage", False)),
    )


def parse_completion_request(body, *, model_name: str) -> CompletionRequest:
    """Check a decoded JSON body against the completions schema.

    Raises:
        ProtocolError: naming the field and the accepted values (HTTP 400), or an unknown
            ``model`` (HTTP 404, as OpenAI answers).
    """
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    check_text_fields(body)
    if "prompt" not in body:
        raise ProtocolError("'prompt' is required", param="prompt")
    check_model(body, model_name)
    if body.get("best_of") not in (None, 1, body.get("n", 1)):
        raise ProtocolError(f"'best_of' = {body['best_of']!r} is not supported", param="best_of")
    if body.get("suffix"):
        raise ProtocolError("'suffix' is not supported", param="suffix")
    options = parse_sampling_options(
        body, default_max_tokens=DEFAULT_MAX_TOKENS, max_tokens_names=("max_tokens",)
    )
    prompts = _parse_prompts(body["prompt"])
    if len(prompts) * options.n > MAX_N:
        raise ProtocolError(
            f"{len(prompts)} prompts x n = {options.n} choices exceed the limit of {MAX_N}",
            param="n",
        )
    logprobs = _get_int(body, "logprobs", None, 0, MAX_LOGPROBS)
    echo = _get(body, "echo", (bool,), False, "a boolean")
    if echo and logprobs is not None:
        raise ProtocolError(
            "'echo' with 'logprobs' (prompt logprobs) is not supported", param="echo"
        )
    return CompletionRequest(
        prompts=prompts,
        options=options,
        logprobs=logprobs,
        echo=echo,
        return_token_ids=_get(body, "return_token_ids", (bool,), False, "a boolean"),
    )


def check_prompt_ids(
    prompt_token_ids: list[int], *, max_tokens: int, vocab_size: int, max_model_len: int
) -> None:
    """Raise ProtocolError (400) if the prompt is empty, has an id outside the vocabulary, or
    does not leave room for ``max_tokens`` within ``max_model_len`` (vLLM's message)."""
    if not prompt_token_ids:
        raise ProtocolError("the prompt is empty", param="prompt")
    slices = [
        prompt_token_ids[start : start + SCAN_SLICE]
        for start in range(0, len(prompt_token_ids), SCAN_SLICE)
    ]
    low, high = min(map(min, slices)), max(map(max, slices))
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
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
            f"requested {num_prompt + max_tokens} tokens ({num_prompt} in the prompt, "
            f"{max_tokens} in the completion). Please reduce the prompt or max_tokens.",
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

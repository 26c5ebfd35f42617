"""The OpenAI chat completions request (``POST /v1/chat/completions``), parsed and checked: OpenAI's
schema as vLLM serves it, with vLLM's extensions (``add_generation_prompt``,
``chat_template_kwargs``, ``stop_token_ids``, ``ignore_eos``); tools and non-text content are
refused. The fields: docs/serving.md#api."""

from __future__ import annotations

from dataclasses import dataclass

from launch.engine.sampler import MAX_LOGPROBS
from launch.serving.openai_protocol import (
    ProtocolError,
    SamplingOptions,
    _get,
    _get_int,
    check_model,
    check_text_fields,
    parse_sampling_options,
)
from launch.text.chat_messages import parse_message


@dataclass(frozen=True, slots=True, kw_only=True)
class ChatCompletionRequest:
    messages: tuple[dict, ...]
    options: SamplingOptions
    logprobs: int | None  # None: no logprobs; k: the sampled token's and the top k
    add_generation_prompt: bool
    chat_template_kwargs: dict


def parse_chat_request(body, *, model_name: str) -> ChatCompletionRequest:
    """Check a decoded JSON body against the chat completions schema.

    Raises:
        ProtocolError: naming the field and the accepted values (HTTP 400), or an unknown
            ``model`` (HTTP 404).
    """
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    check_text_fields(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ProtocolError("'messages' must be a non-empty list of messages", param="messages")
    check_model(body, model_name)
    for name in ("tools", "functions"):
        if body.get(name):
            raise ProtocolError(f"'{name}' is not supported", param=name)
    options = parse_sampling_options(
        body, default_max_tokens=None, max_tokens_names=("max_completion_tokens", "max_tokens")
    )
    want_logprobs = _get(body, "logprobs", (bool,), False, "a boolean")
    top_logprobs = _get_int(body, "top_logprobs", None, 0, MAX_LOGPROBS)
    if top_logprobs is not None and not want_logprobs:
        raise ProtocolError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    try:
        checked = tuple(parse_message(i, m) for i, m in enumerate(messages))
    except ValueError as e:
        raise ProtocolError(str(e), param="messages") from None
    return ChatCompletionRequest(
        messages=checked,
        options=options,
        logprobs=(top_logprobs or 0) if want_logprobs else None,
        add_generation_prompt=_get(body, "add_generation_prompt", (bool,), True, "a boolean"),
        chat_template_kwargs=_get(body, "chat_template_kwargs", (dict,), {}, "an object"),
    )

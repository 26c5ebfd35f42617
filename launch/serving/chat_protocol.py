"""The OpenAI chat completions request (``POST /v1/chat/completions``), parsed and checked.

Follows OpenAI's schema as vLLM serves it: ``messages`` (roles and string content, or content as
a list of ``{"type": "text"}`` parts, joined with newlines as vLLM does for string templates),
``max_completion_tokens`` / ``max_tokens`` (default: up to the context length), ``temperature``,
``top_p``, ``seed``, ``stop``, ``n``, ``logprobs`` / ``top_logprobs``, ``stream`` /
``stream_options``, and vLLM's ``add_generation_prompt``, ``chat_template_kwargs``,
``stop_token_ids``, ``ignore_eos``. Tools and non-text content are refused.
"""

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

ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True, slots=True, kw_only=True)
class ChatCompletionRequest:
    messages: tuple[dict, ...]
    options: SamplingOptions
    logprobs: int | None  # None: no logprobs; k: the sampled token's and the top k
    add_generation_prompt: bool
    chat_template_kwargs: dict


def parse_message(index: int, message) -> dict:
    """``messages[index]`` checked (a role of ``ROLES``; content a string, None or text parts,
    joined with newlines). Raises ProtocolError (a ValueError) naming it."""
    where = f"messages[{index}]"
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ProtocolError(f"{where} must be an object with a 'role' string", param="messages")
    if message["role"] not in ROLES:
        raise ProtocolError(
            f"{where}.role must be one of {', '.join(ROLES)}, got {message['role']!r}",
            param="messages",
        )
    content = message.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" for p in content) or not all(
            isinstance(p.get("text"), str) for p in content
        ):
            raise ProtocolError(
                f"{where}.content: only text parts ({{'type': 'text', 'text': ...}}) are supported",
                param="messages",
            )
        content = "\n".join(p["text"] for p in content)
    elif content is not None and not isinstance(content, str):
        raise ProtocolError(
            f"{where}.content must be a string or a list of text parts", param="messages"
        )
    return {**message, "content": content}


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
    return ChatCompletionRequest(
        messages=tuple(parse_message(i, m) for i, m in enumerate(messages)),
        options=options,
        logprobs=(top_logprobs or 0) if want_logprobs else None,
        add_generation_prompt=_get(body, "add_generation_prompt", (bool,), True, "a boolean"),
        chat_template_kwargs=_get(body, "chat_template_kwargs", (dict,), {}, "an object"),
    )

"""``POST /v1/chat/completions``: messages rendered with the checkpoint's chat template
(``launch.text.chat_template``) and encoded without adding special tokens, as vLLM does, then
generated; answers OpenAI's ``chat.completion`` object or ``chat.completion.chunk`` events.
The answers' format: docs/serving.md#api."""

from __future__ import annotations

import functools
import time

from aiohttp import web

from launch.engine.sampler import TokenLogprobs
from launch.serving.chat_protocol import ChatCompletionRequest, parse_chat_request
from launch.serving.engine_bridge import ServerShuttingDown
from launch.serving.openai_protocol import ProtocolError
from launch.serving.serving_engine import (
    MIN_LOGPROB,
    Choice,
    EngineError,
    OpenAIServing,
    error_event,
    error_response,
    read_json,
    send_event,
    start_event_stream,
    usage_body,
)
from launch.text.chat_template import ChatTemplateError


class OpenAIServingChat(OpenAIServing):
    """The handler of ``POST /v1/chat/completions``; ``config.chat_template`` renders messages."""

    async def __call__(self, http_request: web.Request) -> web.StreamResponse:
        config = self.config
        try:
            request = await read_json(
                http_request,
                functools.partial(parse_chat_request, model_name=config.model_name),
                timeout_s=config.body_read_timeout_s,
            )
            prompt_ids = await self._prompt_ids(request)
            options = request.options
            max_tokens = self.max_tokens_for(prompt_ids, options.max_tokens)
            choices, outputs = self.submit(
                [prompt_ids],
                n=options.n,
                params=lambda _p, j: options.sampling_params(
                    index=j, max_tokens=max_tokens, logprobs=request.logprobs
                ),
                stop=options.stop,
            )
        except (ProtocolError, ServerShuttingDown) as e:
            return self.reject(e)
        try:
            if options.stream:
                return await self._stream(http_request, request, choices, outputs, prompt_ids)
            return await self._whole(request, choices, outputs, prompt_ids)
        finally:
            self.abort_open(choices)  # client gone (handler cancelled, write failed) or an error

    async def _prompt_ids(self, request: ChatCompletionRequest) -> list[int]:
        """The rendered, encoded conversation. Raises ProtocolError (400) without a tokenizer or
        a chat template, or when the template refuses the messages."""
        config = self.config
        if config.tokenizer is None:
            raise ProtocolError(
                "this checkpoint has no tokenizer (tokenizer.json): chat completions need one; "
                "use /v1/completions with token ids",
                param="messages",
            )
        if config.chat_template is None:
            raise ProtocolError(
                "this checkpoint has no chat template (tokenizer_config.json 'chat_template' or "
                "chat_template.jinja): start the server with --chat-template FILE",
                param="messages",
            )
        size = sum(len(m.get("content") or "") for m in request.messages)
        return await self.offload(size, self._render_and_encode, request)

    def _render_and_encode(self, request: ChatCompletionRequest) -> list[int]:
        """Runs off the event loop for large conversations (``offload``)."""
        config = self.config
        try:
            text = config.chat_template.render(
                list(request.messages),
                add_generation_prompt=request.add_generation_prompt,
                variables=request.chat_template_kwargs,
            )
        except ChatTemplateError as e:
            raise ProtocolError(str(e), param="messages") from None
        self.check_text(text, "the rendered conversation", param="messages")
        return config.tokenizer.encode(text, add_special_tokens=False)

    def _head(self, choices: list[Choice], obj: str) -> dict:
        return {
            "id": f"chatcmpl-{choices[0].request_id}",
            "object": obj,
            "created": int(time.time()),
            "model": self.config.model_name,
        }

    def chat_logprobs(self, logprobs: list[TokenLogprobs]) -> dict:
        """OpenAI's chat ``logprobs`` object for these tokens."""

        def entry(token_id: int, logprob: float) -> dict:
            token = self.token_text(token_id)
            return {
                "token": token,
                "logprob": max(logprob, MIN_LOGPROB),
                "bytes": list(token.encode("utf-8")),
            }

        content = []
        for lp in logprobs:
            top = [entry(t, v) for t, v in zip(lp.top_token_ids, lp.top_logprobs, strict=True)]
            content.append({**entry(lp.token_id, lp.logprob), "top_logprobs": top})
        return {"content": content}

    def _logprobs(self, request, logprobs) -> dict | None:
        return None if request.logprobs is None else self.chat_logprobs(list(logprobs))

    async def _whole(self, request, choices, outputs, prompt_ids) -> web.Response:
        try:
            async for _ in self.deltas(choices, outputs):
                pass
        except EngineError as e:
            return error_response(str(e), e.status)
        bodies = [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text.text},
                "logprobs": self._logprobs(request, c.logprobs),
                "finish_reason": c.finish_reason,
            }
            for c in choices
        ]
        usage = usage_body(len(prompt_ids), choices)
        head = self._head(choices, "chat.completion")
        return web.json_response({**head, "choices": bodies, "usage": usage})

    async def _stream(self, http_request, request, choices, outputs, prompt_ids):
        response = await start_event_stream(http_request)
        head = self._head(choices, "chat.completion.chunk")
        try:
            for c in choices:  # the role first, as OpenAI and vLLM send it
                first = {
                    "index": c.index,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                await send_event(response, {**head, "choices": [first]})
            async for delta in self.deltas(choices, outputs):
                c = delta.choice
                if not delta.text and not delta.logprobs and c.finish_reason is None:
                    continue  # text held back (a possible stop string): nothing to send yet
                chunk = {
                    "index": c.index,
                    "delta": {"content": delta.text} if delta.text else {},
                    "logprobs": self._logprobs(request, delta.logprobs),
                    "finish_reason": c.finish_reason,
                }
                await send_event(response, {**head, "choices": [chunk]})
            if request.options.include_usage:
                usage = usage_body(len(prompt_ids), choices)
                await send_event(response, {**head, "choices": [], "usage": usage})
        except EngineError as e:
            self.abort_open(choices)
            await send_event(response, error_event(e))
        await send_event(response, "[DONE]")
        await response.write_eof()
        return response

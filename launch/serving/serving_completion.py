"""``POST /v1/completions``: one or more prompts, ``n`` choices each, optional logprobs and echo.

Answers OpenAI's ``text_completion`` object (whole, or server-sent events ending in
``data: [DONE]``), choices numbered ``prompt_index * n + j`` as vLLM numbers them. Logprobs use the
completions format ``{tokens, token_logprobs, top_logprobs, text_offset}``; each ``top_logprobs``
entry holds the top ``logprobs`` tokens and the sampled one (so up to ``logprobs + 1``), as vLLM's.
"""

from __future__ import annotations

import functools
import time

from aiohttp import web

from launch.engine.sampler import TokenLogprobs
from launch.serving.engine_bridge import ServerShuttingDown
from launch.serving.openai_protocol import (
    CompletionRequest,
    ProtocolError,
    parse_completion_request,
)
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


class OpenAIServingCompletion(OpenAIServing):
    """The handler of ``POST /v1/completions``."""

    async def __call__(self, http_request: web.Request) -> web.StreamResponse:
        config = self.config
        try:
            request = await read_json(
                http_request,
                functools.partial(parse_completion_request, model_name=config.model_name),
                timeout_s=config.body_read_timeout_s,
            )
            prompts = [await self._prompt_ids(i, p) for i, p in enumerate(request.prompts)]
            options = request.options
            max_tokens = [
                await self.offload(len(ids), self.max_tokens_for, ids, options.max_tokens)
                for ids in prompts
            ]
            choices, outputs = self.submit(
                prompts,
                n=options.n,
                params=lambda p, j: options.sampling_params(
                    index=j, max_tokens=max_tokens[p], logprobs=request.logprobs
                ),
                stop=options.stop,
            )
        except (ProtocolError, ServerShuttingDown) as e:
            return self.reject(e)
        try:  # from here on the requests run: every way out aborts what is still open
            echoed = [
                await self._echo_text(request, p, ids)
                for p, ids in zip(request.prompts, prompts, strict=True)
            ]
            if options.stream:
                return await self._stream(http_request, request, choices, outputs, echoed, prompts)
            return await self._whole(request, choices, outputs, echoed, prompts)
        finally:
            self.abort_open(choices)  # client gone (handler cancelled, write failed) or an error

    async def _prompt_ids(self, index: int, prompt: str | tuple[int, ...]) -> list[int]:
        """Prompt ``index``'s token ids; a text is checked to fit before it is encoded. Raises
        ProtocolError (400) without a tokenizer or for a text too long to fit."""
        if not isinstance(prompt, str):
            return await self.offload(len(prompt), list, prompt)
        config = self.config
        if config.tokenizer is None:
            raise ProtocolError(
                "this checkpoint has no tokenizer: send the prompt as a list of token ids",
                param="prompt",
            )
        self.check_text(prompt, f"prompt {index}")
        return await self.offload(len(prompt), config.tokenizer.encode, prompt)

    async def _echo_text(self, request: CompletionRequest, prompt, prompt_ids: list[int]) -> str:
        if not request.echo:
            return ""
        if isinstance(prompt, str):
            return prompt
        tokenizer = self.config.tokenizer
        if tokenizer is None:
            return ""
        return await self.offload(len(prompt_ids), tokenizer.decode, prompt_ids)

    def _head(self, choices: list[Choice]) -> dict:
        return {
            "id": f"cmpl-{choices[0].request_id}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.config.model_name,
        }

    def _choice(self, request, choice: Choice, text: str, token_ids, logprobs, offset: int) -> dict:
        body = {
            "index": choice.index,
            "text": text,
            "logprobs": None
            if request.logprobs is None
            else self.completion_logprobs(logprobs, offset),
            "finish_reason": choice.finish_reason,
        }
        if request.return_token_ids:
            body["token_ids"] = list(token_ids)
        return body

    def completion_logprobs(self, logprobs: list[TokenLogprobs], text_offset: int) -> dict:
        """OpenAI's completions ``logprobs`` object for these tokens, offsets from
        ``text_offset`` (the length of the choice's text before them)."""
        tokens = [self.token_text(lp.token_id) for lp in logprobs]
        offsets = []
        for token in tokens:
            offsets.append(text_offset)
            text_offset += len(token)
        top = []
        for token, lp in zip(tokens, logprobs, strict=True):
            entry = {
                self.token_text(t): max(v, MIN_LOGPROB)
                for t, v in zip(lp.top_token_ids, lp.top_logprobs, strict=True)
            }
            entry.setdefault(token, max(lp.logprob, MIN_LOGPROB))
            top.append(entry)
        return {
            "tokens": tokens,
            "token_logprobs": [max(lp.logprob, MIN_LOGPROB) for lp in logprobs],
            "top_logprobs": top,
            "text_offset": offsets,
        }

    async def _whole(self, request, choices, outputs, echoed, prompts) -> web.Response:
        try:
            async for _ in self.deltas(choices, outputs):
                pass
        except EngineError as e:
            return error_response(str(e), e.status)
        bodies = []
        for c in choices:
            prefix = echoed[c.prompt_index]
            text = prefix + c.text.text
            bodies.append(self._choice(request, c, text, c.token_ids, c.logprobs, len(prefix)))
        usage = usage_body(sum(map(len, prompts)), choices)
        return web.json_response({**self._head(choices), "choices": bodies, "usage": usage})

    async def _stream(self, http_request, request, choices, outputs, echoed, prompts):
        response = await start_event_stream(http_request)
        head = self._head(choices)
        offsets = [len(echoed[c.prompt_index]) for c in choices]
        is_first = [True] * len(choices)
        try:
            async for delta in self.deltas(choices, outputs):
                c = delta.choice
                text = delta.text
                if is_first[c.index]:
                    text, is_first[c.index] = echoed[c.prompt_index] + text, False
                logprobs = list(delta.logprobs)
                body = self._choice(request, c, text, delta.token_ids, logprobs, offsets[c.index])
                if logprobs:
                    offsets[c.index] += sum(len(t) for t in body["logprobs"]["tokens"])
                await send_event(response, {**head, "choices": [body]})
            if request.options.include_usage:
                usage = usage_body(sum(map(len, prompts)), choices)
                await send_event(response, {**head, "choices": [], "usage": usage})
        except EngineError as e:
            self.abort_open(choices)
            await send_event(response, error_event(e))
        await send_event(response, "[DONE]")
        await response.write_eof()
        return response

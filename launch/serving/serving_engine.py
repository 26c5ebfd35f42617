"""What the completions and chat handlers share (as vLLM's ``serving_engine.py``): submitting one
engine request per choice (``n`` per prompt), reading their outputs from one queue, and aborting
what is left when the client goes (``abort_open``, from a handler's ``try/finally``). When an
abort reaches the engine: docs/serving.md#how-requests-are-scheduled."""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from aiohttp import web

from launch.engine.request import SamplingParams
from launch.engine.sampler import TokenLogprobs
from launch.serving.engine_bridge import EngineBridge, RequestOutput, ServerShuttingDown
from launch.serving.http_guard import RETRY_AFTER_S, wait_within
from launch.serving.openai_protocol import (
    ProtocolError,
    ServerBusy,
    check_prompt_ids,
    error_body,
)
from launch.text.detokenizer import LARGE_INPUT, IncrementalText
from launch.text.text_bound import check_prompt_text

MIN_LOGPROB = -9999.0  # JSON has no -inf: vLLM clamps to this


def engine_unavailable_reason(bridge: EngineBridge, stall_timeout_s: float) -> str | None:
    """Why the engine cannot serve now (its loop has not completed an iteration, step or idle
    heartbeat, for over ``stall_timeout_s``: a frozen peer rank blocks the lockstep exchange, or
    a step is stuck), or None."""
    stalled_s = bridge.seconds_since_take
    if stalled_s <= stall_timeout_s:
        return None
    return (
        f"the engine loop has not completed a step or heartbeat for {stalled_s:.1f} s "
        f"(--engine-stall-timeout {stall_timeout_s:g} s): a rank stopped answering or a step "
        f"is stuck; {bridge.num_in_flight} request(s) pending"
    )


class EngineError(RuntimeError):
    """An accepted request failed in the engine (or the server is stopping): ``status`` is the
    HTTP status to answer with, 503 for a ``ServerShuttingDown``, 500 otherwise."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.status = 503 if isinstance(error, ServerShuttingDown) else 500


@dataclass(slots=True, kw_only=True)
class Choice:
    """One generated sequence: engine request ``request_id`` for choice ``index`` of a response."""

    index: int
    request_id: int
    prompt_index: int
    text: IncrementalText
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True, kw_only=True)
class ChoiceDelta:
    """What one engine output added to a choice (``text`` is what is safe to send)."""

    choice: Choice
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs, ...]


def usage_body(num_prompt_tokens: int, choices: list[Choice]) -> dict:
    """OpenAI's ``usage``: prompt tokens (each prompt once, whatever ``n``), generated tokens."""
    num_completion = sum(len(c.token_ids) for c in choices)
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion,
        "total_tokens": num_prompt_tokens + num_completion,
    }


def error_response(message: str, status: int, param: str | None = None) -> web.Response:
    return web.json_response(error_body(message, status=status, param=param), status=status)


async def read_json(http_request: web.Request, parse: Callable, *, timeout_s: float | None = None):
    """``parse(body)`` of the decoded body, read within ``timeout_s``; a large body is decoded
    and parsed off the event loop. Raises ProtocolError: 400 for any body that is not JSON in its
    charset, 415 for a non-JSON Content-Type, 408 for a body that did not arrive in time
    (``launch.serving.http_errors.read_json_body``), and whatever ``parse`` raises."""
    from launch.serving.http_errors import read_json_body

    return await read_json_body(http_request, timeout_s=timeout_s, parse=parse)


def error_event(e: EngineError) -> dict:
    return error_body(str(e), status=e.status)


async def send_event(response: web.StreamResponse, body: dict | str) -> None:
    """One server-sent event (raises ConnectionResetError if the client is gone)."""
    payload = body if isinstance(body, str) else json.dumps(body)
    await response.write(f"data: {payload}\n\n".encode())


async def start_event_stream(http_request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(http_request)
    return response


class OpenAIServing:
    """Base of the endpoint handlers; ``config`` is the server's ``ServerConfig``."""

    def __init__(self, config, bridge: EngineBridge) -> None:
        self.config = config
        self.bridge = bridge

    def reject(self, error: ProtocolError | ServerShuttingDown) -> web.Response:
        """The answer to a request refused before it reached the engine, counted as rejected:
        the protocol error's own status (400, 413, ...), or 503 while shutting down."""
        self.config.metrics.requests_rejected.inc()
        if isinstance(error, ServerShuttingDown):
            return error_response(str(error), 503)
        response = error_response(str(error), error.status, error.param)
        if error.status == 408:  # the rest of the body may never come: do not wait for it
            response.force_close()
        if isinstance(error, ServerBusy):
            response.headers["Retry-After"] = str(RETRY_AFTER_S)
        return response

    def admit(self, num_new: int) -> None:
        """Raise ServerBusy (503) if the engine loop is stuck, or if ``num_new`` more engine
        requests would put more than ``config.max_queued_requests`` in the queue (a request
        is always admitted to an empty queue, whatever its ``n``)."""
        config = self.config
        reason = engine_unavailable_reason(self.bridge, config.engine_stall_timeout_s)
        if reason is not None:
            raise ServerBusy(reason)
        bound = config.max_queued_requests
        num_queued = self.bridge.num_queued
        if bound is not None and num_queued > 0 and num_queued + num_new > bound:
            raise ServerBusy(
                f"the server is busy: {num_queued} request(s) wait to be scheduled "
                f"(--max-queued-requests {bound}); retry later"
            )

    async def offload(self, size: int, fn: Callable, /, *args, **kwargs):
        """``fn(*args, **kwargs)``: inline for a small input (``size`` < ``LARGE_INPUT``
        characters or tokens), else on the event loop's default executor, so that tokenizing or
        detokenizing a large input never stalls other requests (or ``/health``)."""
        if size < LARGE_INPUT:
            return fn(*args, **kwargs)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, functools.partial(fn, *args, **kwargs))

    def check_text(self, text: str, where: str, *, param: str = "prompt") -> None:
        """Raise ProtocolError (400) if ``text`` has more bytes than any prompt that fits the
        context can hold (``launch.text.text_bound.check_prompt_text``), before encoding."""
        try:
            check_prompt_text(
                text,
                where,
                max_model_len=self.config.max_model_len,
                tokenizer=self.config.tokenizer,
            )
        except ValueError as e:
            raise ProtocolError(str(e), param=param) from None

    def max_tokens_for(self, prompt_ids: list[int], max_tokens: int | None) -> int:
        """``max_tokens`` checked against the context and the KV cache; None: all that fits.

        Raises:
            ProtocolError: empty prompt, token outside the vocabulary, or no room (400).
        """
        config = self.config
        room = config.max_model_len
        if config.kv_capacity_tokens is not None:
            room = min(room, config.kv_capacity_tokens)
        if max_tokens is None:
            max_tokens = max(room - len(prompt_ids), 1)
        check_prompt_ids(
            prompt_ids,
            max_tokens=max_tokens,
            vocab_size=config.vocab_size,
            max_model_len=config.max_model_len,
        )
        num_tokens = len(prompt_ids) + max_tokens
        if config.kv_capacity_tokens is not None and num_tokens > config.kv_capacity_tokens:
            raise ProtocolError(
                f"prompt + max_tokens = {num_tokens} tokens exceed the KV cache of a DP rank "
                f"({config.kv_capacity_tokens} tokens)",
                param="max_tokens",
            )
        return max_tokens

    def submit(
        self,
        prompts: list[list[int]],
        *,
        n: int,
        params: Callable[[int, int], SamplingParams],
        stop: tuple[str, ...],
    ) -> tuple[list[Choice], asyncio.Queue[RequestOutput]]:
        """Submit ``n`` engine requests per prompt (choice ``p * n + j``, as vLLM numbers them);
        ``params(prompt_index, j)`` gives each one's sampling parameters. All outputs arrive on
        the returned queue. Raises ServerShuttingDown (503) or ServerBusy (503) before anything
        is submitted."""
        if stop and self.config.tokenizer is None:
            raise ProtocolError(
                "'stop' strings need the checkpoint's tokenizer (tokenizer.json) and this "
                "model has none; use 'stop_token_ids'",
                param="stop",
            )
        self.admit(len(prompts) * n)
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()
        choices: list[Choice] = []
        try:
            for p, prompt_ids in enumerate(prompts):
                for j in range(n):
                    request_id, _ = self.bridge.submit(prompt_ids, params(p, j), outputs)
                    text = IncrementalText(self.config.tokenizer, stop)
                    choices.append(
                        Choice(index=len(choices), request_id=request_id, prompt_index=p, text=text)
                    )
        except BaseException:
            self.abort_open(choices)
            raise
        return choices, outputs

    async def deltas(
        self, choices: list[Choice], outputs: asyncio.Queue[RequestOutput]
    ) -> AsyncIterator[ChoiceDelta]:
        """Each engine output as a ``ChoiceDelta`` until every choice has finished (a stop
        string ends its choice at once: ``finish_reason`` "stop", the engine request aborted).

        Raises:
            EngineError: a choice failed in the engine, or no output came for
                ``config.output_timeout_s`` (the other choices are aborted by ``abort_open``).
        """
        by_id = {c.request_id: c for c in choices}
        num_open = len(choices)
        timeout_s = self.config.output_timeout_s
        while num_open:
            try:  # blocking wait for the engine loop, with a timeout
                output = await wait_within(outputs.get(), timeout_s)
            except asyncio.TimeoutError:
                raise EngineError(
                    TimeoutError(f"no output from the engine for {timeout_s:g} s")
                ) from None
            if output.error is not None:
                raise EngineError(output.error)
            choice = by_id[output.request_id]
            if choice.is_finished:
                continue  # stopped by a stop string; its abort is on its way
            try:
                size = len(choice.text.token_ids) + len(output.new_token_ids)
                text = await self.offload(
                    size, choice.text.add, output.new_token_ids, is_last=output.is_last
                )
            except Exception as e:  # noqa: BLE001 - this request's detokenizing fails it alone
                message = f"detokenizing failed: {type(e).__name__}: {e}"
                raise EngineError(RuntimeError(message)) from e
            choice.token_ids += output.new_token_ids
            choice.logprobs += output.new_logprobs
            if choice.text.stopped:
                choice.finish_reason = "stop"
                self.bridge.abort(choice.request_id)
            elif output.finish_reason is not None:
                choice.finish_reason = output.finish_reason
            num_open -= choice.is_finished
            yield ChoiceDelta(
                choice=choice,
                text=text,
                token_ids=output.new_token_ids,
                logprobs=output.new_logprobs,
            )

    def abort_open(self, choices: list[Choice]) -> None:
        """Abort every choice still generating (client gone, an error, the handler cancelled)."""
        for choice in choices:
            if not choice.is_finished:
                self.bridge.abort(choice.request_id)

    def token_text(self, token_id: int) -> str:
        """A token as logprobs show it: its text, or vLLM's ``token_id:N`` without a tokenizer."""
        tokenizer = self.config.tokenizer
        return f"token_id:{token_id}" if tokenizer is None else tokenizer.token_text(token_id)

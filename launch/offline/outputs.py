"""What ``LLM.generate`` returns: vLLM's ``RequestOutput`` / ``CompletionOutput`` / ``Logprob``
(``vllm/outputs.py``, ``vllm/logprobs.py``), with the fields users read."""

from __future__ import annotations

from dataclasses import dataclass, field

from launch.engine.request import Request
from launch.engine.sampler import TokenLogprobs


@dataclass(frozen=True, slots=True)
class Logprob:
    """One token's log probability; ``rank`` is its 1-based rank in the vocabulary (None where
    unknown: the sampled token when it is not among the top ``logprobs``), ``decoded_token`` its
    text (None without a tokenizer)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(slots=True, kw_only=True)
class CompletionOutput:
    """One generated sequence of a prompt (``index`` in ``[0, n)``).

    ``text`` is the decoded ``token_ids`` (special tokens skipped), cut before the first stop
    string; ``""`` without a tokenizer. ``finish_reason`` is ``"stop"`` (eos, a stop token or a
    stop string), ``"length"`` (``max_tokens`` or ``max_model_len``) or ``"error"`` (this request
    alone failed, e.g. non-finite logits: ``error`` says why). ``stop_reason`` is the stop string
    or stop token id that ended it (None at eos or length). ``logprobs`` (if asked): per generated
    token a dict token id -> ``Logprob`` holding the sampled token and the top ``logprobs``.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None  # this engine's addition: why finish_reason is "error"

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True, kw_only=True)
class RequestOutput:
    """The result of one prompt: ``prompt`` (its text; None for a token-id prompt),
    ``prompt_token_ids`` and its ``outputs`` (``n`` sequences). ``request_id`` is unique within
    one ``LLM`` on one DP rank."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    prompt_logprobs: None = None  # prompt logprobs are not implemented
    finished: bool = True


def vllm_logprobs(entries: list[TokenLogprobs], token_text) -> list[dict[int, Logprob]]:
    """The engine's per-token logprobs in vLLM's shape; ``token_text(id)`` names a token (or
    None). The top tokens come first in rank order, then the sampled token if not among them."""
    result = []
    for entry in entries:
        tokens = {
            token_id: Logprob(logprob, rank, token_text(token_id))
            for rank, (token_id, logprob) in enumerate(
                zip(entry.top_token_ids, entry.top_logprobs, strict=True), 1
            )
        }
        if entry.token_id not in tokens:
            tokens[entry.token_id] = Logprob(entry.logprob, None, token_text(entry.token_id))
        result.append(tokens)
    return result


def completion_output(index: int, request: Request, text: str, tokenizer) -> CompletionOutput:
    """The ``CompletionOutput`` of a finished engine request (``text`` already decoded)."""
    params = request.sampling_params
    token_ids = list(request.output_token_ids)
    stop_reason = None
    if request.finish_reason == "stop" and token_ids and token_ids[-1] in params.stop_token_ids:
        stop_reason = token_ids[-1]
    logprobs = cumulative = None
    if params.logprobs is not None:
        token_text = (lambda _t: None) if tokenizer is None else tokenizer.token_text
        logprobs = vllm_logprobs(request.output_logprobs, token_text)
        cumulative = sum(e.logprob for e in request.output_logprobs)
    return CompletionOutput(
        index=index,
        text=text,
        token_ids=token_ids,
        cumulative_logprob=cumulative,
        logprobs=logprobs,
        finish_reason=request.finish_reason,
        stop_reason=stop_reason,
        error=request.error,
    )

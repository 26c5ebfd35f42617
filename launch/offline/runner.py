"""One ``LLM.generate`` call on one DP rank: its prompts become engine requests (``n`` per
prompt), and the engine steps in DP lockstep until no rank has work, exactly as
``LLMEngine.run_until_done`` does (a rank with nothing left runs dummy batches, so the expert
all-to-all and the DBO vote keep every rank in step). Stop strings are matched on the text after
each step and end their request at once, as the server does."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

from launch.engine.request import Request, SamplingParams, offset_seed
from launch.offline.outputs import RequestOutput, completion_output
from launch.offline.prompts import ParsedPrompt
from launch.text.detokenizer import IncrementalText


@dataclass(slots=True, kw_only=True)
class Sequence:
    """Engine request ``request`` generating sequence ``index`` of prompt ``prompt_index``;
    ``text`` follows its output when the prompt has stop strings (None otherwise)."""

    prompt_index: int
    index: int
    request: Request
    text: IncrementalText | None = None
    stop_reason: str | None = None


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """The engine's parameters of choice ``index`` of ``n`` (seeds ``seed + index``)."""
    if params.n == 1:
        return params
    seed = None if params.seed is None else offset_seed(params.seed, index)
    return dataclasses.replace(params, n=1, seed=seed)


class OfflineRun:
    """Engine requests for ``prompts`` (token ids set) with ``params`` (one per prompt)."""

    def __init__(
        self, engine, tokenizer, prompts: list[ParsedPrompt], params: list[SamplingParams], ids
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.prompts = prompts
        self.params = params
        self.sequences: dict[int, Sequence] = {}
        self.first_request_ids: list[int] = []  # per prompt: its RequestOutput's request_id
        for p, (prompt, sp) in enumerate(zip(prompts, params, strict=True)):
            for j in range(sp.n):
                request = Request(
                    request_id=next(ids),
                    prompt_token_ids=list(prompt.token_ids),
                    sampling_params=choice_params(sp, j),
                )
                if j == 0:
                    self.first_request_ids.append(request.request_id)
                text = IncrementalText(tokenizer, sp.stop) if sp.stop else None
                self.sequences[request.request_id] = Sequence(
                    prompt_index=p, index=j, request=request, text=text
                )

    def run(self, progress=None) -> list[RequestOutput]:
        """Add the requests, step until every DP rank is done, return one output per prompt
        (input order). Collective: every DP rank runs it (with its own prompts, maybe none)."""
        for sequence in self.sequences.values():
            self.engine.add_request(sequence.request)
        with_stop = [s for s in self.sequences.values() if s.text is not None]
        while True:
            finished, any_work = self.engine.step()
            if with_stop:
                finished += self._apply_stop_strings(with_stop)
            if progress is not None and finished:
                progress.update(len(finished))
            if not any_work:
                return self._outputs()

    def _apply_stop_strings(self, with_stop: list[Sequence]) -> list[Request]:
        """Feed new tokens to each running sequence's text; end those a stop string matched."""
        stopped = []
        for sequence in with_stop:
            request = sequence.request
            if request.finish_reason is not None:
                continue
            self._feed(sequence, is_last=False)
            if sequence.text.stopped and self.engine.abort_request(request.request_id):
                request.finish_reason = "stop"  # not "abort": the stop string ended it
                stopped.append(request)
        return stopped

    def _feed(self, sequence: Sequence, *, is_last: bool) -> None:
        text = sequence.text
        was_stopped = text.stopped
        text.add(sequence.request.output_token_ids[len(text.token_ids) :], is_last=is_last)
        if text.stopped and not was_stopped:
            full = self.tokenizer.decode(text.token_ids)
            hits = [(full.find(s), s) for s in text.stop if s in full]
            sequence.stop_reason = min(hits)[1]

    def _outputs(self) -> list[RequestOutput]:
        outputs = [
            RequestOutput(
                request_id=str(self.first_request_ids[p]),
                prompt=prompt.text,
                prompt_token_ids=list(prompt.token_ids),
            )
            for p, prompt in enumerate(self.prompts)
        ]
        for sequence in self.sequences.values():
            outputs[sequence.prompt_index].outputs.append(self._completion(sequence))
        return outputs

    def _completion(self, sequence: Sequence):
        request = sequence.request
        if sequence.text is not None:
            self._feed(sequence, is_last=True)  # the last tokens may complete a stop string
            text = sequence.text.text
            if sequence.text.stopped and request.finish_reason != "error":
                request.finish_reason = "stop"
        elif self.tokenizer is not None:
            text = self.tokenizer.decode(request.output_token_ids)
        else:
            text = ""
        output = completion_output(sequence.index, request, text, self.tokenizer)
        if sequence.stop_reason is not None:
            output.stop_reason = sequence.stop_reason
        return output


def request_ids():
    """Request ids of one ``LLM`` (unique on its DP rank across calls)."""
    return itertools.count()

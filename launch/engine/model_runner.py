"""Model runner: one engine step from a ``SchedulerOutput`` to sampled tokens (``ModelRunner``,
after vLLM's ``GPUModelRunner``): the DP vote, the step's inputs, the forward (with DBO's ubatches
when every rank agreed) and sampling. The step in order: docs/dbo.md#model-runner-one-step."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass, field

import torch

from dbo import (
    AdaptiveDBOPolicy,
    DPMicrobatchDecision,
    PolicyChoice,
    UBatchSlice,
    UBatchWrapper,
    coordinate_batch_across_dp,
    make_ubatch_slices,
    should_ubatch_locally,
)
from dbo.forward_context import DPMetadata, ForwardContext, get_forward_context, set_forward_context
from dbo.timeline.recorder import blocking_comm_span, record_policy_span, timeline_span
from distributed.comm_handle import comm_error
from launch.engine.arg_utils import AUTO, MIN_DBO_THRESHOLD, EngineArgs
from launch.engine.input_batch import InputBatch, ModelInputs
from launch.engine.kv_cache_manager import KVCacheManager
from launch.engine.sampler import (
    SampledResults,
    Sampler,
    SamplingMetadata,
    TokenLogprobs,
    logprob_values,
    unpack_logprobs,
)
from launch.engine.scheduler import SchedulerOutput
from moe.layers.attention_metadata import split_attn_metadata
from moe.platforms import current_platform


@dataclass(frozen=True, slots=True, kw_only=True)
class StepOutput:
    sampled_token_ids: dict[int, int]  # request_id -> token
    # request_id -> why sampling failed for that request alone (its own parameters or data); the
    # scheduler finishes it with that error while the step and every other request go on
    failed_request_ids: dict[int, str]
    has_work_across_dp: tuple[bool, ...]
    ran_model: bool
    is_ubatched: bool
    num_tokens: int  # this rank's real tokens
    num_ubatches: int  # ubatches the model ran on (1 without microbatching or without a run)
    num_tokens_padded: int  # rows the model ran on this rank (0 when it did not run)
    # request_id -> logprobs of its sampled token, for the requests that asked for them
    sampled_logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)
    adaptive: PolicyChoice | None = None  # the adaptive policy's choice, if it governed the step


@dataclass(frozen=True, slots=True, kw_only=True)
class ForwardOutput:
    hidden_states: torch.Tensor | None  # [num_rows, hidden_size]; None if the model did not run
    inputs: ModelInputs | None
    has_work_across_dp: tuple[bool, ...]
    is_ubatched: bool
    adaptive: PolicyChoice | None = None
    num_ubatches: int = 1  # ubatches the model ran on (1 without microbatching)


class ModelRunner:
    """Runs the model for one step on this DP rank, coordinating microbatching with the others.

    ``model`` provides ``forward(input_ids, positions, attn_metadata) -> [num_tokens, hidden_size]``
    and ``compute_logits(hidden_states) -> [n, vocab_size] float32``; ``groups`` is the
    ``distributed.ParallelGroups`` of this process.
    """

    def __init__(
        self,
        *,
        model: torch.nn.Module,
        kv_cache_manager: KVCacheManager,
        engine_args: EngineArgs,
        groups,
        max_num_blocks_per_req: int,
    ) -> None:
        self.model = model
        self.kv_cache_manager = kv_cache_manager
        self.args = engine_args
        self.groups = groups
        self.max_num_blocks_per_req = max_num_blocks_per_req
        self.platform = current_platform()
        self.wrapper = UBatchWrapper(
            self._forward,
            timeout_s=engine_args.distributed_timeout_s,
            make_streams=self.platform.make_ubatch_streams,
        )
        self.input_batch = InputBatch(
            max_num_reqs=engine_args.max_num_seqs,
            max_model_len=max_num_blocks_per_req * kv_cache_manager.block_size,
            max_num_blocks_per_req=max_num_blocks_per_req,
            kv_cache_manager=kv_cache_manager,
            default_seed=engine_args.seed,
            device=groups.device,
            pin_memory=self.platform.pin_host_memory(groups.device),
            num_token_rows=engine_args.max_num_batched_tokens,
        )
        self.sampler = Sampler()
        # Learns per batch shape whether microbatching pays; used for the kinds whose threshold is
        # "auto". Kept across set_dbo() calls, so the benchmark can interleave it with static arms.
        self.adaptive_policy = AdaptiveDBOPolicy(prior=engine_args.adaptive_prior())
        self.clock_ns = time.perf_counter_ns  # step timer of the adaptive policy (tests fake it)
        self._prev_step_us = 0  # this rank's time of its previous step, sent in the next vote

    def set_dbo(self, *, enable_dbo: bool, **settings: int | str | None) -> None:
        """Switch DBO and its settings (``dbo_decode_token_threshold=…``, ``…prefill…``: an int or
        "auto"; ``ubatch_size=N``) for the following steps, e.g. the benchmark's off / on /
        adaptive arms and its ubatch counts.

        Raises:
            ValueError: as EngineArgs raises it for the new values.
        """
        self.args = dataclasses.replace(self.args, enable_dbo=enable_dbo, **settings)

    def _local_vote(self, num_tokens: int, is_decode_only: bool) -> tuple[bool, bool]:
        """(vote, can_ubatch): the static threshold vote (an ``auto`` kind votes whenever it can)
        and whether this rank could microbatch at all."""
        a = self.args
        can_ubatch = a.enable_dbo and num_tokens >= MIN_DBO_THRESHOLD
        if not can_ubatch:
            return False, False

        def numeric(threshold: int | str) -> int:
            return MIN_DBO_THRESHOLD if threshold == AUTO else threshold

        vote = should_ubatch_locally(
            num_tokens=num_tokens,
            is_decode_only=is_decode_only,
            decode_token_threshold=numeric(a.dbo_decode_token_threshold),
            prefill_token_threshold=numeric(a.dbo_prefill_token_threshold),
        )
        return vote, True

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The model on this (u)batch's rows, with the attention metadata of its forward context."""
        # inference_mode is thread-local: each ubatch thread must enter it itself.
        with torch.inference_mode():
            return self.model(input_ids, positions, get_forward_context().attn_metadata)

    def execute_model(self, scheduler_output: SchedulerOutput) -> StepOutput:
        """Coordinate with the other DP ranks, run the model if any rank has work, sample."""
        for request in scheduler_output.preempted:  # their blocks are gone: rows rebuilt later
            self.input_batch.remove_request(request.request_id)
        forward = self.run_forward(scheduler_output)
        sampled, logprobs, failed = {}, {}, {}
        if forward.hidden_states is not None:
            sampled, logprobs, failed = self._sample(forward.hidden_states, forward.inputs)
        return StepOutput(
            sampled_token_ids=sampled,
            sampled_logprobs=logprobs,
            failed_request_ids=failed,
            has_work_across_dp=forward.has_work_across_dp,
            ran_model=forward.hidden_states is not None,
            is_ubatched=forward.is_ubatched,
            num_tokens=scheduler_output.num_tokens,
            num_ubatches=forward.num_ubatches,
            num_tokens_padded=0
            if forward.inputs is None
            else forward.inputs.attn_metadata.num_tokens,
            adaptive=forward.adaptive,
        )

    def run_forward(self, scheduler_output: SchedulerOutput) -> ForwardOutput:
        """The DP vote, then the model on this rank's batch (microbatched if all ranks agreed).

        Returns the hidden states of every row ([num_rows, hidden_size]) or None when this rank had
        no reason to run the model (no work here, and no expert all-to-all to take part in).
        """
        num_tokens = scheduler_output.num_tokens
        has_work = num_tokens > 0
        g = self.groups
        decision = self._vote(scheduler_output)
        # The step time the policy compares: from here to the end of the forward, i.e. what
        # microbatching changes (padding, slicing, the model), not the vote's wait for peers.
        start_ns = self.clock_ns()
        self._prev_step_us = 0
        has_work_across_dp = tuple(decision.has_work_across_dp)
        # Without EP there is no collective inside the model: an idle rank need not run a dummy.
        needs_dummy = any(has_work_across_dp) and g.ep_size > 1
        if not has_work and not needs_dummy:
            return ForwardOutput(
                hidden_states=None,
                inputs=None,
                has_work_across_dp=has_work_across_dp,
                is_ubatched=False,
                adaptive=decision.adaptive,
            )
        num_rows = decision.num_tokens_padded if decision.should_ubatch else max(num_tokens, 1)
        inputs = self.input_batch.prepare_inputs(scheduler_output, num_rows=num_rows)
        hidden_states = self._run_model(decision, inputs, num_rows)
        self._end_step_timing(start_ns, decision)
        return ForwardOutput(
            hidden_states=hidden_states,
            inputs=inputs,
            has_work_across_dp=has_work_across_dp,
            is_ubatched=decision.should_ubatch,
            adaptive=decision.adaptive,
            num_ubatches=decision.num_ubatches,
        )

    def _run_model(
        self, decision: DPMicrobatchDecision, inputs: ModelInputs, num_rows: int
    ) -> torch.Tensor:
        """The model on this step's ``num_rows`` rows inside the batch's forward context, and under
        DBO each ubatch inside its own (its slice of the attention metadata, its row counts)."""
        if decision.should_ubatch:
            # every DP rank padded to the same num_rows (the vote's agreement)
            num_tokens_across_dp = (num_rows,) * self.groups.dp_size
        else:
            # Every rank runs max(num_tokens, 1) rows (a dummy row when idle): known from the vote,
            # so e.g. DeepEP's low-latency dispatch sizes its slots without a message (vLLM's
            # forward-context DP metadata).
            num_tokens_across_dp = tuple(max(n, 1) for n in decision.num_tokens_across_dp)
        batch = ForwardContext(
            attn_metadata=inputs.attn_metadata,
            dp_metadata=self._dp_metadata(num_tokens_across_dp),
        )
        ubatch_slices = ubatch_scopes = None
        if decision.should_ubatch:
            qsl = inputs.attn_metadata.query_start_loc
            ubatch_slices = make_ubatch_slices(qsl, num_rows, decision.num_ubatches)
            ubatch_scopes = [
                set_forward_context(context)
                for context in self._ubatch_contexts(ubatch_slices, inputs)
            ]
        with set_forward_context(batch):
            return self.wrapper(
                inputs.input_ids, inputs.positions, ubatch_slices, ubatch_scopes=ubatch_scopes
            )

    def _ubatch_contexts(
        self, ubatch_slices: list[UBatchSlice], inputs: ModelInputs
    ) -> list[ForwardContext]:
        """Each ubatch's forward context: its slice of the attention metadata and its row counts."""
        metadata = split_attn_metadata(ubatch_slices, inputs.attn_metadata)
        # Every DP rank padded to the same num_rows and cut it at the same points, so each ubatch
        # has the same row count on every rank; telling the all-to-all spares it a blocking
        # count exchange in the overlapped window.
        return [
            ForwardContext(
                attn_metadata=ubatch_metadata,
                dp_metadata=self._dp_metadata((s.num_tokens,) * self.groups.dp_size),
                ubatch_id=k,
            )
            for k, (s, ubatch_metadata) in enumerate(zip(ubatch_slices, metadata, strict=True))
        ]

    def _dp_metadata(self, num_tokens_across_dp: tuple[int, ...]) -> DPMetadata:
        return DPMetadata(
            num_tokens_across_dp=num_tokens_across_dp,
            dp_rank_of_ep_rank=self.groups.dp_rank_of_ep_rank,
        )

    def _vote(self, scheduler_output: SchedulerOutput) -> DPMicrobatchDecision:
        """This rank's vote and previous step time, all-gathered over DP, and the decision (the
        adaptive policy's for ``auto`` kinds)."""
        num_tokens = scheduler_output.num_tokens
        has_work = num_tokens > 0
        vote, can_ubatch = self._local_vote(num_tokens, scheduler_output.is_decode_only)
        g = self.groups
        with blocking_comm_span("dp_vote"), _naming_dp_vote_errors(g):
            return coordinate_batch_across_dp(  # blocking collective over DP (group timeout)
                num_tokens=num_tokens,
                has_work=has_work,
                vote=vote,
                dp_group=g.dp_comm,
                dp_rank=g.dp_rank,
                dp_size=g.dp_size,
                is_decode_only=scheduler_output.is_decode_only or not has_work,
                can_ubatch=can_ubatch,
                prev_step_us=self._prev_step_us,
                policy=self.adaptive_policy,
                adaptive_kinds=self.args.adaptive_dbo_kinds
                if self.args.enable_dbo
                else frozenset(),
                num_ubatches=self.args.num_ubatches,
            )

    def _end_step_timing(self, start_ns: int, decision: DPMicrobatchDecision) -> None:
        """Keep this step's time for the next vote; mark an exploration step on the timeline.
        Only while the adaptive policy runs (a threshold ``auto``): otherwise nothing reads the
        time, and the step neither times itself nor synchronises the device."""
        if not (self.args.enable_dbo and self.args.adaptive_dbo_kinds):
            return  # _prev_step_us stays 0: "not measured"
        # host-device sync where ops are asynchronous (CUDA): else the policy would time launches
        self.platform.synchronize(self.groups.device)
        end_ns = self.clock_ns()
        self._prev_step_us = max((end_ns - start_ns) // 1000, 1)
        choice = decision.adaptive
        if choice is not None and choice.is_exploring:
            arm = "on" if decision.should_ubatch else "off"
            record_policy_span(
                f"explore {arm}",
                start_ns=start_ns,
                end_ns=end_ns,
                args={"bucket": choice.bucket.label, "ubatch": decision.should_ubatch},
            )

    def _sample(
        self, hidden_states, inputs: ModelInputs
    ) -> tuple[dict[int, int], dict[int, TokenLogprobs], dict[int, str]]:
        """(request_id -> sampled token, request_id -> logprobs of those that asked for them (from
        the raw logits: vLLM's default), request_id -> error) for every sampled row.

        All rows are sampled in one vectorized call. Whatever fails because of one request (its
        logits, the sampler on its row) fails that request alone: NaN rows are checked for every
        step, and only when the batched call raises are the rows sampled one by one to find the
        ones at fault. The step goes on for every other request, so the DP lockstep is never
        broken by one request's data. The tokens, the NaN flags and the logprob rows come back in
        ONE device-to-host copy (``SampledResults``); nothing else is read.
        """
        if not inputs.sampled_request_ids:
            return {}, {}, {}
        metadata = inputs.sampling_metadata
        with torch.inference_mode(), timeline_span("sample"):
            logits = self.model.compute_logits(hidden_states[inputs.logits_indices])
            # a row's max is NaN iff the row has a NaN (max propagates NaN): one reduction, no
            # [rows, vocab] bool temporary (several times cheaper than isnan(logits).any(-1))
            is_nan = torch.isnan(logits.amax(dim=-1))
            tokens, errors = self._sample_isolating_failures(logits, metadata)
            # rows whose request asked for logprobs, from the host-side parameters
            logprob_rows = [row for row, n in enumerate(metadata.num_logprobs) if n >= 0]
            num_top = [metadata.num_logprobs[row] for row in logprob_rows]
            logprobs = None
            if logprob_rows:
                with timeline_span("logprobs"):
                    logprobs = logprob_values(logits[logprob_rows], tokens[logprob_rows], num_top)
            results = SampledResults.read(tokens, is_nan, logprobs)
        ids = inputs.sampled_request_ids
        nan_error = "the model produced NaN logits for this request"
        errors = {**dict.fromkeys(results.nan_rows, nan_error), **errors}
        failed = {ids[row]: error for row, error in errors.items()}
        tokens_list = results.token_ids
        sampled = {r: tokens_list[row] for row, r in enumerate(ids) if row not in errors}
        if not logprob_rows:
            return sampled, {}, failed
        per_row = unpack_logprobs(
            results.logprob_values, [tokens_list[row] for row in logprob_rows], num_top
        )
        wanted = {
            ids[row]: row_logprobs
            for row, row_logprobs in zip(logprob_rows, per_row, strict=True)
            if row not in errors
        }
        return sampled, wanted, failed

    def _sample_isolating_failures(
        self, logits: torch.Tensor, metadata: SamplingMetadata
    ) -> tuple[torch.Tensor, dict[int, str]]:
        """(token ids [num_rows] int64, row -> error). The batched sampler first; if it raises,
        each row alone, so that only the rows whose own data make it fail are failed."""
        try:
            return self.sampler(logits, metadata), {}
        except Exception:  # noqa: BLE001 - find the row(s) at fault below
            pass
        tokens = torch.zeros(logits.shape[0], dtype=torch.int64, device=logits.device)
        errors: dict[int, str] = {}
        for row in range(logits.shape[0]):  # failure path only, never in a normal step
            try:
                tokens[row] = self.sampler(logits[row : row + 1], metadata.select([row]))[0]
            except Exception as e:  # noqa: BLE001 - one request's sampling: fail it alone
                errors[row] = f"sampling failed: {type(e).__name__}: {e}"
        return tokens, errors

    def release(self, request_id: int) -> None:
        """Forget a finished or aborted request's per-request state."""
        self.input_batch.remove_request(request_id)


@contextlib.contextmanager
def _naming_dp_vote_errors(groups):
    """Re-raise a failed DP vote naming it (gloo's timeout names no collective; shared memory's
    raises TimeoutError naming the rank)."""
    try:
        yield
    except (RuntimeError, TimeoutError) as exc:
        op = "the DP vote (all_to_all over the DP group)"
        raise comm_error(op, groups.rank, groups.timeout, exc) from exc

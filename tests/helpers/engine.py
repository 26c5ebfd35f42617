"""Engine-level helpers shared by the multi-rank logits tests: run a few teacher-forced steps,
the DBO test configuration, and the DBO on == DBO off == reference check."""

from __future__ import annotations

import torch

from tests.helpers.precision import FLOAT32_REL, reference_rel

NUM_DECODE_STEPS = 2


def run_engine_steps(engine, prompts, dp_rank, dp_size):
    """Prefill this DP rank's share of ``prompts`` (every ``dp_size``-th from ``dp_rank``), then
    ``NUM_DECODE_STEPS`` greedy decode steps; (logits rows per request id as numpy, the greedy
    tokens per request id, the ubatches of each step: 1 when it was not microbatched)."""
    from launch.engine.request import Request, SamplingParams

    for index in range(dp_rank, len(prompts), dp_size):
        engine.add_request(
            Request(
                request_id=index,
                prompt_token_ids=list(prompts[index]),
                sampling_params=SamplingParams(max_tokens=NUM_DECODE_STEPS + 2),
            )
        )
    logits: dict[int, list[torch.Tensor]] = {}
    ubatched = []
    for _ in range(1 + NUM_DECODE_STEPS):
        scheduler_output = engine.scheduler.schedule()
        forward = engine.model_runner.run_forward(scheduler_output)
        ubatched.append(forward.num_ubatches)
        qsl = forward.inputs.attn_metadata.query_start_loc.tolist()
        with torch.inference_mode():
            rows = engine.model.compute_logits(forward.hidden_states[: qsl[-1]])
        sampled = {}
        for i, item in enumerate(scheduler_output.scheduled):
            request_logits = rows[qsl[i] : qsl[i + 1]]
            logits.setdefault(item.request.request_id, []).append(request_logits.clone())
            sampled[item.request.request_id] = int(request_logits[-1].argmax())
        engine.scheduler.update_from_output(scheduler_output, sampled)
    tokens = {r.request_id: r.output_token_ids[:NUM_DECODE_STEPS] for r in engine.running_requests}
    # numpy, not tensors: tensors cross the result queue in shared memory that dies with the rank
    return {i: torch.cat(v).cpu().numpy() for i, v in logits.items()}, tokens, ubatched


def dbo_test_engine_args(model_dir, world_size, enable_dbo, **overrides):
    """float32, EP over all ranks, thresholds low enough that every tiny step is microbatched."""
    from launch.engine.arg_utils import EngineArgs

    return EngineArgs(
        **{
            "model": model_dir,
            "dtype": "float32",
            "data_parallel_size": world_size,
            "enable_expert_parallel": True,
            "enable_dbo": enable_dbo,
            "dbo_decode_token_threshold": 2,
            "dbo_prefill_token_threshold": 4,
            "max_num_batched_tokens": 4096,
            "distributed_timeout_s": 60,
            **overrides,
        }
    )


def _reference_logits(model, full: torch.Tensor, cache: dict | None) -> torch.Tensor:
    """``model``'s float64 logits of every position of ``full`` ([1, seq_len] ids), remembered in
    ``cache`` (if given) for callers that check several engines against the same reference."""
    key = (id(model), tuple(full[0].tolist()))
    if cache is not None and key in cache:
        return cache[key]
    with torch.no_grad():
        logits = model(full).logits[0, : full.shape[1]].double()
    if cache is not None:
        cache[key] = logits
    return logits


def assert_dbo_on_equals_off_equals_reference(
    on_per_rank,
    off_per_rank,
    reference,
    prompts,
    label: str = "",
    exact_reference=None,
    model_type: str | None = None,
    device_type: str = "cpu",
    cache: dict | None = None,
):
    """Each rank's DBO-on steps were all microbatched (into two ubatches or more), DBO-off none;
    both gave the same tokens, and each one's logits are within a bound of the exact (float64)
    logits of prompt + generated tokens, so DBO on and off are within twice that of each other.
    ``label`` prefixes the failure messages; ``cache`` (a dict) keeps the reference logits between
    calls that check several engines against the same reference.

    The exact logits come from ``reference`` if it is float64, else from ``exact_reference`` (the
    same checkpoint in float64; required then). For float64 engines the bound is
    ``precision.reference_rel(model_type, device_type)`` of the largest exact |logit| of each
    request (the engines computed on a ``device_type`` device). For float32 it is derived, never
    fixed: the larger of ``precision.FLOAT32_REL`` of the largest
    |logit| and 4x the float32 ``reference``'s own distance from the exact logits, which measures
    what float32 rounding does to this model on this machine (its GEMMs' blocking and summation
    order vary by CPU and ISA: 2.5e-5 on one Qwen2-MoE logit on a Zen 3 and a Zen 5 EPYC, within
    1e-5 on a Xeon); ours is a second, independent float32 rounding of the same sums."""

    def msg(m: str) -> str:
        return f"{label}: {m}" if label else m

    cache = {} if cache is None else cache
    exact = reference if reference.dtype == torch.float64 else exact_reference
    is_exact = reference.dtype == torch.float64
    if exact is None or (model_type is None) == is_exact:
        raise ValueError(
            "float64 references take model_type; float32 ones exact_reference and no model_type"
        )
    for (on_logits, on_tokens, on_ubatched), (off_logits, off_tokens, off_ubatched) in zip(
        on_per_rank, off_per_rank, strict=True
    ):
        assert all(n >= 2 for n in on_ubatched) and set(off_ubatched) == {1}, msg(
            f"ubatches per step: DBO on {on_ubatched}, off {off_ubatched}"
        )
        assert on_tokens == off_tokens, msg(f"tokens: DBO on {on_tokens}, off {off_tokens}")
        for index, logits in on_logits.items():
            full = torch.tensor([prompts[index] + on_tokens[index]])
            # rows: every prompt position, then one row per decode step (positions P, P+1)
            ref = _reference_logits(reference, full, cache)
            ref64 = _reference_logits(exact, full, cache)
            if is_exact:
                bound = reference_rel(model_type, device_type) * ref64.abs().max().item()
            else:
                own = 4 * (ref - ref64).abs().max().item()
                bound = max(FLOAT32_REL * ref64.abs().max().item(), own)
            on, off = (
                torch.from_numpy(logits).double(),
                torch.from_numpy(off_logits[index]).double(),
            )
            torch.testing.assert_close(on, ref64, rtol=0, atol=bound, msg=msg)
            torch.testing.assert_close(off, ref64, rtol=0, atol=bound, msg=msg)
            torch.testing.assert_close(on, off, rtol=0, atol=2 * bound, msg=msg)

"""Engine-level helpers shared by the multi-rank logits tests: run a few teacher-forced steps,
the DBO test configuration, and the DBO on == DBO off == reference check."""

from __future__ import annotations

import torch

NUM_DECODE_STEPS = 2


def run_engine_steps(engine, prompts, dp_rank, dp_size):
    """Prefill this DP rank's share of ``prompts`` (every ``dp_size``-th from ``dp_rank``), then
    ``NUM_DECODE_STEPS`` greedy decode steps; (logits rows per request id as numpy, the greedy
    tokens per request id, whether each step was microbatched)."""
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
        ubatched.append(forward.is_ubatched)
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
    # numpy, not tensors: tensors cross the result queue through shared memory that dies with the rank
    return {i: torch.cat(v).numpy() for i, v in logits.items()}, tokens, ubatched


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


def assert_dbo_on_equals_off_equals_reference(
    on_per_rank,
    off_per_rank,
    reference,
    prompts,
    label: str = "",
    atol: float = 1e-5,
    exact_reference=None,
):
    """Each rank's DBO-on steps were all microbatched, DBO-off none; both gave the same tokens and
    logits (``atol``: 1e-5 suits float32), equal to ``reference``'s logits on prompt + generated
    tokens. ``label`` prefixes the failure messages.

    The comparison with the reference is against its exact (float64) logits: ``reference`` itself
    if it is float64, else ``exact_reference`` (the same checkpoint in float64; without it the
    comparison is with ``reference`` at ``atol``). The float32 reference's own distance from the
    exact logits
    measures what float32 rounding does to this model on this machine (its GEMMs' blocking and
    summation order vary by CPU: 2.5e-5 on one Qwen2-MoE logit on a Zen 5 EPYC, within 1e-5 on a
    Xeon); ours may be up to 4x as far (two independent float32 roundings of the same sums, with
    margin), and never needs to be closer than ``atol``."""

    def msg(m: str) -> str:
        return f"{label}: {m}" if label else m

    exact = reference if reference.dtype == torch.float64 else exact_reference

    for (on_logits, on_tokens, on_ubatched), (off_logits, off_tokens, off_ubatched) in zip(
        on_per_rank, off_per_rank, strict=True
    ):
        assert all(on_ubatched) and not any(off_ubatched), label
        assert on_tokens == off_tokens, label
        for index, logits in on_logits.items():
            logits = torch.from_numpy(logits)
            torch.testing.assert_close(
                logits, torch.from_numpy(off_logits[index]), rtol=0, atol=atol, msg=msg
            )
            full = torch.tensor([prompts[index] + on_tokens[index]])
            with torch.no_grad():
                # rows: every prompt position, then one row per decode step (positions P, P+1)
                ref = reference(full).logits[0, : full.shape[1]].double()
                ref64 = ref if exact is None else exact(full).logits[0, : full.shape[1]]
            bound = max(atol, 4 * (ref - ref64).abs().max().item())
            torch.testing.assert_close(logits.double(), ref64, rtol=0, atol=bound, msg=msg)

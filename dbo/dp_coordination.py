"""The DP-wide decision whether this step microbatches, and into how many ubatches (vLLM's
``coordinate_batch_across_dp``): one all-gather of every DP rank's vote, token count and (adaptive
policy) step time; ``DPMicrobatchDecision``. The rule: docs/dbo.md, "The DP-wide decision"."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from dbo.adaptive_policy import AdaptiveDBOPolicy, Bucket, PolicyChoice
from dbo.ubatch_slicing import max_num_ubatches
from distributed.communicator import Communicator, as_communicator

# columns of the gathered [dp_size, 7] int64 table
_NUM_TOKENS, _VOTE, _HAS_WORK, _IS_DECODE_ONLY, _CAN_UBATCH, _PREV_STEP_US, _NUM_UBATCHES = range(7)
NUM_VOTE_COLUMNS = 7


@dataclass(frozen=True, slots=True, kw_only=True)
class DPMicrobatchDecision:
    """What every DP rank agreed on for one step.

    Fields:
        should_ubatch: all ranks microbatch this step (identical on every rank).
        num_tokens_across_dp: ``[dp_size]`` each DP rank's real token count.
        num_tokens_padded: if ``should_ubatch``, the max token count over DP (every rank pads to
            it); else this rank's own count.
        has_work_across_dp: ``[dp_size]`` whether each rank has any scheduled request.
        adaptive: the adaptive policy's choice if it governed this step (its kind is ``auto``),
            else None; ``should_ubatch`` may still be False if the choice was infeasible.
        num_ubatches: ubatches every rank cuts its batch into (>= 2 if ``should_ubatch``, else 1).
    """

    should_ubatch: bool
    num_tokens_across_dp: list[int]
    num_tokens_padded: int
    has_work_across_dp: list[bool]
    adaptive: PolicyChoice | None = None
    num_ubatches: int = 1

    def __post_init__(self) -> None:
        if len(self.num_tokens_across_dp) != len(self.has_work_across_dp):
            raise ValueError(
                f"num_tokens_across_dp ({len(self.num_tokens_across_dp)} ranks) and "
                f"has_work_across_dp ({len(self.has_work_across_dp)} ranks) must have one entry "
                f"per DP rank"
            )
        if self.num_tokens_padded < 0:
            raise ValueError(f"num_tokens_padded must be >= 0, got {self.num_tokens_padded}")
        if (self.num_ubatches >= 2) != self.should_ubatch or self.num_ubatches < 1:
            raise ValueError(
                f"num_ubatches must be >= 2 when microbatching, else 1; got {self.num_ubatches} "
                f"with should_ubatch={self.should_ubatch}"
            )


def should_ubatch_locally(
    *,
    num_tokens: int,
    is_decode_only: bool,
    decode_token_threshold: int,
    prefill_token_threshold: int,
) -> bool:
    """This rank's vote: a decode-only batch needs ``num_tokens >= decode_token_threshold``, a batch
    with any prefill ``num_tokens >= prefill_token_threshold`` (vLLM's ``--dbo-*-token-threshold``).

    Raises:
        ValueError: if a count or threshold is negative.
    """
    for name, value in (
        ("num_tokens", num_tokens),
        ("decode_token_threshold", decode_token_threshold),
        ("prefill_token_threshold", prefill_token_threshold),
    ):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    threshold = decode_token_threshold if is_decode_only else prefill_token_threshold
    return num_tokens >= threshold


def _check_table(
    rows: Tensor, dp_rank: int, *, has_policy: bool, adaptive_kinds: frozenset[str]
) -> None:
    """``decide_from_gathered``'s argument checks (ValueError as it documents)."""
    if rows.dim() != 2 or rows.shape[1] != NUM_VOTE_COLUMNS or rows.shape[0] < 1:
        raise ValueError(
            f"rows must be [dp_size >= 1, {NUM_VOTE_COLUMNS}], got shape {tuple(rows.shape)}"
        )
    dp_size = rows.shape[0]
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank must be in [0, {dp_size}), got {dp_rank}")
    if adaptive_kinds and not has_policy:
        raise ValueError(f"adaptive_kinds {sorted(adaptive_kinds)} need a policy")


def _agreed_num_ubatches(table: list[list[int]], num_tokens: list[int]) -> int:
    """The ubatch count of a step every rank microbatches: the smallest any rank asked for,
    lowered while some rank, padded to the largest token count, would run a ubatch without a real
    token (its real tokens all lie before the ubatch's first row); 1: not even two ubatches."""
    requested = min(int(r[_NUM_UBATCHES]) for r in table)
    return max_num_ubatches(max(num_tokens), min(num_tokens), requested)


def decide_from_gathered(
    rows: Tensor,
    dp_rank: int,
    *,
    policy: AdaptiveDBOPolicy | None = None,
    adaptive_kinds: frozenset[str] = frozenset(),
) -> DPMicrobatchDecision:
    """Turn the gathered per-rank table into this rank's decision (no communication).

    Static kinds: microbatch iff every rank voted yes. A kind in ``adaptive_kinds`` (the step's
    kind is "prefill" if any rank with work has a prefill): microbatch iff every rank can and
    ``policy`` chooses to. Either way into N ubatches, N the smallest ``num_ubatches`` of any row,
    lowered to the most that leave a real token in every ubatch of every rank
    (``ubatch_slicing.max_num_ubatches``); not at all if even two would not. With a
    ``policy``, the slowest rank's previous step time is first recorded into it, and the step that
    runs now is noted for the next call; the policy's state changes only as a function of the
    table, so ranks that hold the same table stay identical.

    Args:
        rows: ``[dp_size, 7]`` int64 (any integer dtype, any device), one row per DP rank:
            ``(num_tokens, vote, has_work, is_decode_only, can_ubatch, prev_step_us,
            num_ubatches)``; flags 0 or 1, ``prev_step_us`` the rank's time of its previous step
            in microseconds (0: not measured), ``num_ubatches`` the ubatches the rank asks for.
        dp_rank: this rank's row, in ``[0, dp_size)``.
        policy: the adaptive policy (one per rank, fed the same tables on every rank).
        adaptive_kinds: the kinds ("decode", "prefill") whose threshold is ``auto``.

    Raises:
        ValueError: on a wrong shape, an out-of-range ``dp_rank``, or adaptive kinds without policy.
    """
    _check_table(rows, dp_rank, has_policy=policy is not None, adaptive_kinds=adaptive_kinds)
    table = rows.tolist()  # host-device sync if rows live on a GPU (a few ints)
    num_tokens = [int(r[_NUM_TOKENS]) for r in table]
    has_work = [bool(r[_HAS_WORK]) for r in table]
    should_ubatch = all(bool(r[_VOTE]) for r in table)
    choice = None
    if policy is not None:
        policy.record(max(int(r[_PREV_STEP_US]) for r in table) / 1000.0)
        if any(has_work):
            is_decode_only = all(bool(r[_IS_DECODE_ONLY]) for r in table if r[_HAS_WORK])
            bucket = Bucket.of(num_tokens=max(num_tokens), is_decode_only=is_decode_only)
            if bucket.kind in adaptive_kinds:
                choice = policy.choose(bucket)
                should_ubatch = choice.use_ubatch and all(bool(r[_CAN_UBATCH]) for r in table)
    max_num_tokens = max(num_tokens)
    num_ubatches = _agreed_num_ubatches(table, num_tokens) if should_ubatch else 1
    should_ubatch = num_ubatches >= 2
    if choice is not None:
        policy.begin_step(choice.bucket, should_ubatch)
    return DPMicrobatchDecision(
        should_ubatch=should_ubatch,
        num_tokens_across_dp=num_tokens,
        num_tokens_padded=max_num_tokens if should_ubatch else num_tokens[dp_rank],
        has_work_across_dp=has_work,
        adaptive=choice,
        num_ubatches=num_ubatches,
    )


def coordinate_batch_across_dp(
    *,
    num_tokens: int,
    has_work: bool,
    vote: bool,
    dp_group: ProcessGroup | Communicator | None,
    dp_rank: int,
    dp_size: int,
    is_decode_only: bool = True,
    can_ubatch: bool | None = None,
    prev_step_us: int = 0,
    policy: AdaptiveDBOPolicy | None = None,
    adaptive_kinds: frozenset[str] = frozenset(),
    num_ubatches: int = 2,
) -> DPMicrobatchDecision:
    """Exchange every DP rank's row (see ``decide_from_gathered``) and decide.

    One all-gather of every rank's row into a ``[dp_size, 7]`` int64 table over ``dp_group``, done
    as an ``all_to_all_single`` (each rank sends its row to every rank): on gloo, faster for a
    table this small than the ``all_reduce`` of a zero-filled table it replaces; ``dp_group`` is
    the DP group's communicator (or the process group: torch.distributed's). On an NCCL group
    the table lives on the current CUDA device. ``dp_size == 1`` skips communication. Every rank
    gets the same ``should_ubatch``. ``can_ubatch`` (default: ``vote``) says whether this rank could
    microbatch at all, for the adaptive policy; ``prev_step_us`` is this rank's measured time of its
    previous step (0: none); ``num_ubatches`` the ubatches this rank asks for when it microbatches
    (``--ubatch-size``; the ranks use the smallest asked for).

    Raises:
        ValueError: on an out-of-range ``dp_rank``, a negative count, ``num_ubatches < 2``, a
            missing ``dp_group`` with ``dp_size > 1`` or a group whose size is not ``dp_size``.
        RuntimeError/TimeoutError: from the collective (the group's timeout applies).
    """
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"need dp_size >= 1 and 0 <= dp_rank < dp_size, got {dp_rank}/{dp_size}")
    if num_tokens < 0 or prev_step_us < 0:
        raise ValueError(
            f"num_tokens and prev_step_us must be >= 0, got {num_tokens}, {prev_step_us}"
        )
    if num_ubatches < 2:
        raise ValueError(f"num_ubatches must be >= 2, got {num_ubatches}")
    can_ubatch = vote if can_ubatch is None else can_ubatch
    rows = torch.zeros(dp_size, NUM_VOTE_COLUMNS, dtype=torch.int64)
    row = (num_tokens, vote, has_work, is_decode_only, can_ubatch, prev_step_us, num_ubatches)
    rows[dp_rank] = torch.tensor([int(x) for x in row])  # in the _NUM_TOKENS ... column order
    if dp_size > 1:
        if dp_group is None:
            raise ValueError(f"dp_group is required when dp_size={dp_size} > 1")
        comm = as_communicator(dp_group)
        if comm.size != dp_size:
            raise ValueError(f"dp_group has {comm.size} ranks, expected dp_size={dp_size}")
        device = comm.tensor_device
        mine = rows[dp_rank].to(device).expand(dp_size, NUM_VOTE_COLUMNS).contiguous()
        rows = torch.empty(dp_size, NUM_VOTE_COLUMNS, dtype=torch.int64, device=device)
        work, after = comm.all_to_all_single(
            rows, mine, output_split_sizes=None, input_split_sizes=None
        )
        work.wait()  # blocking wait (timeout: the group's); row r of the result is rank r's row
        if after is not None:
            after()
    return decide_from_gathered(rows, dp_rank, policy=policy, adaptive_kinds=adaptive_kinds)

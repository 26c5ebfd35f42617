"""Dual Batch Overlap: ubatch slicing (token and request bounds), the DP-wide microbatching decision
(static thresholds or the adaptive policy), the ping-pong protocol between ubatch threads, the
wrapper that runs a model on ubatches, the forward context (one (u)batch's per-thread state) and a
timeline recorder. The overlap machinery only: the attention metadata is opaque here."""

from dbo.adaptive_policy import (
    AdaptiveDBOPolicy,
    AdaptivePolicyConfig,
    Bucket,
    PolicyChoice,
    format_crossover,
    prior_from_table,
)
from dbo.dp_coordination import (
    DPMicrobatchDecision,
    coordinate_batch_across_dp,
    decide_from_gathered,
    should_ubatch_locally,
)
from dbo.forward_context import (
    DPMetadata,
    ForwardContext,
    get_forward_context,
    set_forward_context,
)
from dbo.timeline.recorder import (
    TimelineRecorder,
    TimelineSpan,
    get_timeline_recorder,
    record_comm_span,
    set_timeline_recorder,
    timeline_span,
)
from dbo.ubatch_context import (
    UBatchAborted,
    UBatchContext,
    dbo_current_ubatch_id,
    dbo_enabled,
    dbo_maybe_run_recv_hook,
    dbo_register_recv_hook,
    dbo_switch_to_comm,
    dbo_switch_to_compute,
    dbo_yield,
    make_ubatch_contexts,
)
from dbo.ubatch_slicing import UBatchSlice, make_ubatch_slices
from dbo.ubatch_wrapper import UBatchWrapper

__all__ = [
    "AdaptiveDBOPolicy",
    "AdaptivePolicyConfig",
    "Bucket",
    "PolicyChoice",
    "format_crossover",
    "prior_from_table",
    "DPMetadata",
    "DPMicrobatchDecision",
    "ForwardContext",
    "TimelineRecorder",
    "TimelineSpan",
    "UBatchAborted",
    "UBatchContext",
    "UBatchSlice",
    "UBatchWrapper",
    "coordinate_batch_across_dp",
    "dbo_current_ubatch_id",
    "dbo_enabled",
    "get_forward_context",
    "set_forward_context",
    "dbo_maybe_run_recv_hook",
    "dbo_register_recv_hook",
    "dbo_switch_to_comm",
    "dbo_switch_to_compute",
    "dbo_yield",
    "decide_from_gathered",
    "get_timeline_recorder",
    "make_ubatch_contexts",
    "make_ubatch_slices",
    "record_comm_span",
    "set_timeline_recorder",
    "should_ubatch_locally",
    "timeline_span",
]

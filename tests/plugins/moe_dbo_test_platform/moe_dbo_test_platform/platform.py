"""A CPU-like device that answers several platform questions differently from ``CpuPlatform``."""

import torch

from moe.platforms import ComputeDtype, ConfigUpdate, Platform


class PluginPlatform(Platform):
    name = "plugin_cpu"
    dispatch_key = "oot"  # ops bind forward_oot (forward_native where an op has none)
    issue_before_recv_hook = False  # vLLM's transfer order
    supported_dtypes = (torch.float32, torch.float64, torch.bfloat16)

    def prepare_kernels(self) -> str | None:
        return "plugin kernels ready"

    def compute_dtype(self, dtype: torch.dtype) -> ComputeDtype:
        chosen = super().compute_dtype(dtype)
        if dtype == torch.bfloat16:
            return ComputeDtype(dtype=torch.float32, reason="the plugin device computes in float32")
        return chosen

    def check_and_update_config(self, args) -> ConfigUpdate:
        update = super().check_and_update_config(args)
        if args.max_num_seqs <= 8:
            return update
        return ConfigUpdate(
            changes={**update.changes, "max_num_seqs": 8},
            notes=(*update.notes, "--max-num-seqs capped at 8 by the plugin device"),
        )

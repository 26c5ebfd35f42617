"""Makes torch in vLLM's venv report an AVX2-only CPU (``peer_table --cpu-isa avx2``): on its
``PYTHONPATH`` this runs at every interpreter start, engine processes included, before vLLM picks
its kernel build (``_C_AVX2``), its attention ISA and its MoE path from these probes. Paired with
``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`` for torch's and oneDNN's own dispatch."""

import torch

for _probe in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_amx_tile_supported"):
    if hasattr(torch.cpu, _probe):
        setattr(torch.cpu, _probe, lambda: False)

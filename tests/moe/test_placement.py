"""Where a rank computes: the device-selection logic driven with fake device counts, the refusal
line, and the platform chosen by ``MOE_DBO_PLATFORM``."""

from __future__ import annotations

import pytest
import torch

from moe.platforms import CpuPlatform
from moe.platforms.placement import SHARE_FLAG, accelerator_index
from moe.platforms.plugins import resolve_platform
from tests.helpers.gpu import fake_cuda_platform


@pytest.mark.parametrize(
    ("local_world_size", "device_count", "expected"),
    [
        (1, 1, [(0, 1)]),
        (2, 2, [(0, 1), (1, 1)]),
        (2, 8, [(0, 1), (1, 1)]),  # more devices than ranks: the first ones
        (4, 2, [(0, 2), (1, 2), (0, 2), (1, 2)]),  # shared round-robin
        (3, 2, [(0, 2), (1, 1), (0, 2)]),
        (2, 1, [(0, 2), (0, 2)]),  # two ranks on one GPU
    ],
)
def test_each_local_rank_gets_its_device_and_the_count_sharing_it(
    local_world_size, device_count, expected
):
    got = [
        accelerator_index(
            local_rank=r,
            local_world_size=local_world_size,
            device_count=device_count,
            share_devices=True,
        )
        for r in range(local_world_size)
    ]
    assert got == expected


def test_fewer_devices_than_ranks_is_refused_in_one_line_naming_both_counts():
    with pytest.raises(ValueError) as info:
        accelerator_index(local_rank=1, local_world_size=2, device_count=1, share_devices=False)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("2 ranks on this node but 1 CUDA device(s) visible")
    assert SHARE_FLAG in message


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(local_rank=0, local_world_size=1, device_count=0), "no CUDA device is visible"),
        (dict(local_rank=2, local_world_size=2, device_count=2), r"LOCAL_RANK must be in \[0, 2\)"),
    ],
)
def test_no_device_or_a_bad_local_rank_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        accelerator_index(share_devices=True, **kwargs)


@pytest.mark.parametrize(
    ("count", "share", "backends"),
    [(2, False, ["nccl", "nccl"]), (1, True, ["gloo", "gloo"]), (4, False, ["nccl", "nccl"])],
)
def test_cuda_ranks_use_nccl_unless_they_share_a_device(monkeypatch, count, share, backends):
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    platform = fake_cuda_platform(count)
    placements = [
        platform.place_rank(local_rank=r, local_world_size=2, share_devices=share) for r in (0, 1)
    ]
    assert [p.dist_backend for p in placements] == backends
    expected = [torch.device("cuda", r % count) for r in (0, 1)]
    assert [p.device for p in placements] == expected
    assert all(p.is_shared == share for p in placements)


def test_cuda_refuses_two_ranks_on_one_device_without_the_flag(monkeypatch):
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: pytest.fail("must not be set"))
    with pytest.raises(ValueError, match="2 ranks on this node but 1 CUDA device"):
        fake_cuda_platform(1).place_rank(local_rank=0, local_world_size=2)


def test_the_cpu_platform_places_every_rank_on_the_host():
    placement = CpuPlatform().place_rank(local_rank=3, local_world_size=4, share_devices=True)
    assert (placement.device, placement.dist_backend, placement.is_shared) == (
        torch.device("cpu"),
        "gloo",
        False,
    )


def test_moe_dbo_platform_picks_the_platform(monkeypatch):
    monkeypatch.setenv("MOE_DBO_PLATFORM", "cpu")
    assert resolve_platform().name == "cpu"
    monkeypatch.setenv("MOE_DBO_PLATFORM", "tpu")
    with pytest.raises(ValueError, match=r"MOE_DBO_PLATFORM='tpu' is not one of \['cpu', 'cuda'"):
        resolve_platform()
    if not torch.cuda.is_available():
        monkeypatch.setenv("MOE_DBO_PLATFORM", "cuda")
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_platform()

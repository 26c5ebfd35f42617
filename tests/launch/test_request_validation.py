"""Every bad input is refused up front with one line naming the value and the accepted range.

vLLM's SamplingParams rules (temperature below 1e-5 is greedy, NaN/inf refused, seeds within
torch.iinfo(torch.long)), alike in SamplingParams, the HTTP protocol and the engine flags; output
paths probed writable (checkpoints: ``tests/moe/test_checkpoint_checks.py``).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from launch.engine.arg_utils import EngineArgs
from launch.engine.output_paths import check_output_dir, check_output_file
from launch.engine.request import MAX_SEED, MIN_SEED, SamplingParams
from launch.generate import prompt_seed
from launch.serving.openai_protocol import ProtocolError, parse_completion_request


def test_the_seed_range_is_the_one_the_generator_takes():
    generator = torch.Generator()
    for seed in (MIN_SEED, MAX_SEED, 2**64 - 1):
        generator.manual_seed(seed)
    with pytest.raises((RuntimeError, ValueError)):
        generator.manual_seed(2**64)  # what took the server down before
    for seed in (MIN_SEED, -1, 0, MAX_SEED):
        assert SamplingParams(temperature=1.0, seed=seed).seed == seed


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"seed": 2**64}, r"seed must be in \[-2\*\*63, 2\*\*63 - 1\].*got 18446744073709551616"),
        ({"seed": -(2**63) - 1}, r"seed must be in"),
        ({"seed": 1.5}, r"seed must be an integer"),
        ({"temperature": math.nan}, r"temperature must be a finite number >= 0.*got nan"),
        ({"temperature": math.inf}, r"temperature must be a finite number >= 0.*got inf"),
        ({"temperature": -0.1}, r"temperature must be a finite number >= 0"),
        ({"max_tokens": 0}, r"max_tokens must be an integer >= 1, got 0"),
        ({"max_tokens": True}, r"max_tokens must be an integer >= 1"),
    ],
)
def test_sampling_params_refuse(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    ("temperature", "is_greedy"), [(0.0, True), (1e-300, True), (9.9e-6, True), (1e-5, False)]
)
def test_temperature_below_vllm_epsilon_is_greedy(temperature, is_greedy):
    assert SamplingParams(temperature=temperature).is_greedy is is_greedy


@pytest.mark.parametrize(
    ("body", "status", "pattern"),
    [
        ({"seed": 2**64}, 400, r"'seed' must be in \[-2\*\*63, 2\*\*63 - 1\]"),
        ({"seed": 10**4000}, 400, r"'seed' must be in .*an integer of 4001 digits"),
        ({"temperature": math.nan}, 400, r"'temperature' must be in \[0, 2\], got nan"),
        ({"temperature": 10**400}, 400, r"'temperature' must be in \[0, 2\], got inf"),
        ({"max_tokens": 10**4000}, 400, r"'max_tokens' must be >= 1|exceeds"),
        ({"prompt": [[[5]]]}, 400, r"token-id lists, got \[\[\[5\]\]\]"),
        ({"prompt": [[5], [[6]]]}, 400, r"token-id lists, got \[\[5\], \[\[6\]\]\]"),
    ],
)
def test_protocol_refuses(body, status, pattern):
    with pytest.raises(ProtocolError, match=pattern) as info:
        request = parse_completion_request({"prompt": [5], **body}, model_name="m")
        from launch.serving.openai_protocol import check_prompt_ids

        for prompt in request.prompts:
            check_prompt_ids(
                list(prompt),
                max_tokens=request.options.max_tokens,
                vocab_size=128,
                max_model_len=64,
            )
    assert info.value.status == status


def test_protocol_takes_a_tiny_temperature_as_greedy_and_a_long_seed():
    request = parse_completion_request(
        {"prompt": [5], "temperature": 1e-300, "seed": MAX_SEED}, model_name="m"
    )
    params = request.options.sampling_params(index=0, max_tokens=4, logprobs=None)
    assert params.is_greedy and params.seed == MAX_SEED
    second = request.options.sampling_params(index=1, max_tokens=4, logprobs=None)
    assert second.seed == MIN_SEED  # n > 1 wraps instead of overflowing the generator


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"seed": 2**64}, r"--seed must be in \[-2\*\*63, 2\*\*63 - 1\]"),
        ({"distributed_timeout_s": math.nan}, r"--distributed-timeout must be in \(0, 86400\]"),
        ({"distributed_timeout_s": math.inf}, r"--distributed-timeout must be in"),
        ({"distributed_timeout_s": 0}, r"--distributed-timeout must be in"),
        ({"dtype": "float16"}, r"choose one of \('float32', 'bfloat16', 'float64'\)"),
    ],
)
def test_engine_args_refuse(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        EngineArgs(**kwargs)


def test_per_prompt_seeds_stay_in_range():
    assert prompt_seed(5, 3) == 8
    assert prompt_seed(MAX_SEED, 1) == MIN_SEED  # wraps instead of overflowing the generator
    SamplingParams(temperature=1.0, seed=prompt_seed(MAX_SEED, 10**6))


def test_output_paths_are_probed(tmp_path):
    check_output_file(str(tmp_path / "new" / "dir" / "out.jsonl"), "--output")
    assert (tmp_path / "new" / "dir").is_dir()
    assert not (tmp_path / "new" / "dir" / "out.jsonl").exists()  # no file left behind
    assert os.listdir(tmp_path / "new" / "dir") == []  # nor the probe
    check_output_dir(str(tmp_path / "timeline"), "--timeline-dir")
    with pytest.raises(OSError, match=r"^--output '/proc/nonexist/out.jsonl' is not writable"):
        check_output_file("/proc/nonexist/out.jsonl", "--output")
    with pytest.raises(OSError, match=r"^--timeline-dir '/proc/nonexist' is not writable"):
        check_output_dir("/proc/nonexist", "--timeline-dir")
    with pytest.raises(OSError, match=r"is a directory"):
        check_output_file(str(tmp_path), "--output")
    (tmp_path / "file").write_text("x")
    with pytest.raises(OSError, match=r"exists and is not a directory"):
        check_output_dir(str(tmp_path / "file"), "--timeline-dir")
    assert (tmp_path / "file").read_text() == "x"  # an existing --output is not truncated

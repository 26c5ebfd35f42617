"""Flag validation: each contradiction is refused with a message naming the value and the rule."""

import pytest

from launch.engine.arg_utils import EngineArgs
from launch.generate import build_parser, check_prompts, load_prompts


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        (
            {"enable_dbo": True, "enable_expert_parallel": True},
            r"--enable-dbo needs --data-parallel-size >= 2",
        ),
        (
            {"enable_dbo": True, "data_parallel_size": 2},
            r"--enable-dbo needs --enable-expert-parallel",
        ),
        (
            {"all2all_backend": "nccl"},
            r"'nccl' is not supported; choose one of \('all_to_all', 'allgather_reducescatter', "
            r"'deepep_high_throughput', 'deepep_low_latency'\)",
        ),
        ({"dtype": "float16"}, r"--dtype 'float16' is not supported"),
        ({"max_num_seqs": 0}, r"--max-num-seqs must be >= 1, got 0"),
        (
            {"dbo_decode_token_threshold": 1},
            r"--dbo-decode-token-threshold must be an integer >= 2 or 'auto', got 1",
        ),
        (
            {"dbo_prefill_token_threshold": "fast"},
            r"--dbo-prefill-token-threshold must be an integer >= 2 or 'auto', got 'fast'",
        ),
        (
            {"ubatch_size": 1},
            r"--ubatch-size \(ubatches per microbatched step\) must be an integer in \[2, 16\], "
            r"got 1",
        ),
        ({"ubatch_size": 17}, r"--ubatch-size .* got 17"),
        ({"max_model_len": 0}, r"--max-model-len must be >= 1"),
        (
            {"emulate_link": "latency_us=inf,gbps=1"},
            r"--emulate-link 'latency_us=inf,gbps=1': expected finite latency_us >= 0 \(µs\) "
            r"and gbps > 0 \(Gbit/s\)",
        ),
        ({"emulate_link": "latency_us=1,gbps=inf"}, r"expected finite latency_us"),
    ],
)
def test_bad_engine_args(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        EngineArgs(**kwargs)


def test_default_all2all_backend_under_dbo_is_the_platforms():
    from distributed import BACKENDS
    from moe.platforms import current_platform
    from moe.platforms.interface import CpuPlatform, CudaPlatform

    dbo = {"enable_dbo": True, "enable_expert_parallel": True, "data_parallel_size": 2}
    assert EngineArgs(**dbo).all2all_backend == current_platform().dbo_all2all_backend
    # a GPU reads counts on the host only through a sync: its default never does inside the window
    assert not BACKENDS[CudaPlatform.dbo_all2all_backend].blocks_under_dbo
    assert CpuPlatform.dbo_all2all_backend == "all_to_all"  # host reads are free on the host
    assert EngineArgs().all2all_backend == "all_to_all"
    for name in BACKENDS:  # an explicit choice is kept, DBO or not
        assert EngineArgs(**dbo, all2all_backend=name).all2all_backend == name
        assert EngineArgs(all2all_backend=name).all2all_backend == name
    ns = build_parser().parse_args(["--enable-dbo"])
    assert ns.all2all_backend is None  # resolved by EngineArgs, which knows --enable-dbo


def test_all2all_backend_choices_are_the_registrys_names(capsys):
    from distributed import BACKENDS

    parser = build_parser()
    (action,) = [a for a in parser._actions if "--all2all-backend" in a.option_strings]
    assert list(action.choices) == list(BACKENDS)
    with pytest.raises(ValueError, match=r"--all2all-backend 'nccl' is not supported"):
        EngineArgs(all2all_backend="nccl")


def test_world_size_must_match_data_parallel_size():
    with pytest.raises(ValueError, match=r"--data-parallel-size 4 does not match the 2 rank\(s\)"):
        EngineArgs(data_parallel_size=4).check_world_size(2)


def test_parser_errors_are_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["--all2all-backend", "bogus"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "invalid choice: 'bogus'" in err


def test_dbo_thresholds_take_a_number_or_auto(capsys):
    from launch.engine.arg_utils import engine_args_from_namespace

    ns = build_parser().parse_args(
        ["--dbo-decode-token-threshold", "auto", "--dbo-prefill-token-threshold", "256"]
    )
    args = engine_args_from_namespace(ns)
    assert args.dbo_decode_token_threshold == "auto" and args.dbo_prefill_token_threshold == 256
    assert args.adaptive_dbo_kinds == frozenset({"decode"})
    assert EngineArgs().adaptive_dbo_kinds == frozenset()
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["--dbo-decode-token-threshold", "fast"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "expected an integer >= 2 or 'auto', got 'fast'" in err


def test_load_prompts_names_the_bad_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt_token_ids": [1, 2]}\n\n{"prompt": "hi"}\n')
    with pytest.raises(
        ValueError, match=r"p.jsonl:3: expected a JSON object \{'prompt_token_ids'.*a text prompt"
    ):
        load_prompts(str(path))
    path.write_text('{"prompt_token_ids": [1, 2]}\n{"prompt_token_ids": [3]}\n')
    assert load_prompts(str(path)) == [[1, 2], [3]]
    # issue 28 case 7: deep nesting (RecursionError) and a huge int are one-line ValueErrors too
    path.write_text("[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(
        ValueError, match=r"p.jsonl:1: expected a JSON object .*JSON nested too deeply"
    ):
        load_prompts(str(path))
    path.write_text('{"prompt_token_ids": [' + "9" * 5000 + "]}\n")
    with pytest.raises(ValueError, match=r"p.jsonl:1: expected a JSON object .*4300"):
        load_prompts(str(path))


def test_check_prompts():
    check_prompts([[1, 2, 3]], vocab_size=10, max_model_len=4)
    with pytest.raises(
        ValueError,
        match=r"prompt 1 has 4 tokens; with max_model_len 4 \(--max-model-len\) prompts must have "
        r"at most 3",
    ):
        check_prompts([[1], [1, 2, 3, 4]], vocab_size=10, max_model_len=4)
    with pytest.raises(ValueError, match=r"prompt 0 has token id 10 outside \[0, 10\)"):
        check_prompts([[10]], vocab_size=10, max_model_len=4)


def test_ubatch_size_counts_ubatches_and_needs_dbo():
    from launch.engine.arg_utils import engine_args_from_namespace

    dbo = ["--enable-dbo", "--enable-expert-parallel", "--data-parallel-size", "2"]
    assert engine_args_from_namespace(build_parser().parse_args(dbo)).num_ubatches == 2
    for flag in ("--ubatch-size", "--num-ubatches"):  # vLLM's name and the plain one
        args = engine_args_from_namespace(build_parser().parse_args([*dbo, flag, "3"]))
        assert args.ubatch_size == args.num_ubatches == 3
    with pytest.raises(ValueError, match="--ubatch-size 3 needs --enable-dbo"):
        engine_args_from_namespace(build_parser().parse_args(["--ubatch-size", "3"]))

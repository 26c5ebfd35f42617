"""The offline API (``from launch import LLM, SamplingParams``) against transformers and the
server, on 1 rank in process and on 2 DP ranks under torchrun with EP and DBO.

Greedy float64 generation equals transformers' float64 ``generate`` on the same ids on any CPU
(see tests/helpers/precision.py), so texts are compared exactly. ``LLM.chat`` is compared with the
server's chat completions handler (aiohttp test server) answering the same messages, its engine
requests run by the same engine.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys

import pytest

from launch import LLM, SamplingParams
from tests.helpers.chat import build_chat_tokenizer
from tests.helpers.distributed import REPO, TORCHRUN_ENV, torchrun_command
from tests.helpers.offline_ranks import CHAT, text_of

MAX_TOKENS = 8  # transformers_greedy's max_new_tokens


@pytest.fixture(scope="module")
def llm(tiny_chat_dir):
    llm = LLM(tiny_chat_dir, dtype="float64", max_model_len=64, block_size=4)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def hf_texts(transformers_greedy) -> list[str]:
    """transformers' greedy continuations decoded by transformers' tokenizer."""
    tokenizer = build_chat_tokenizer()
    return [tokenizer.decode(ids, skip_special_tokens=True) for ids in transformers_greedy]


def server_chat(llm: LLM, model_dir: str, messages: list[dict], max_tokens: int) -> dict:
    """The server's ``/v1/chat/completions`` answer (greedy), its one engine request run by
    ``llm``'s engine as the serve loop would."""
    from aiohttp.test_utils import TestClient, TestServer

    from launch.serving.api_server import ServerConfig, build_app
    from launch.serving.engine_bridge import EngineBridge, RequestOutput
    from launch.serving.metrics import ServerMetrics
    from launch.text.chat_template import load_chat_template

    config = ServerConfig(
        model_name="m",
        max_model_len=64,
        vocab_size=128,
        tokenizer=llm.get_tokenizer(),
        metrics=ServerMetrics(dp_size=1),
        chat_template=load_chat_template(model_dir, None),
    )
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0}

    async def go():
        bridge = EngineBridge(asyncio.get_running_loop())
        async with TestClient(TestServer(build_app(config, bridge))) as client:
            answer = asyncio.create_task(client.post("/v1/chat/completions", json=body))
            new: list = []
            while not new:
                await asyncio.sleep(0.02)
                new, _ = bridge.take(0)
            prompt = {"prompt_token_ids": list(new[0].prompt_token_ids)}
            out = llm.generate(prompt, new[0].sampling_params, use_tqdm=False)[0].outputs[0]
            bridge.deliver(
                RequestOutput(
                    request_id=new[0].request_id,
                    new_token_ids=tuple(out.token_ids),
                    finish_reason=out.finish_reason,
                )
            )
            response = await answer
            return await response.json()

    return asyncio.run(go())


def test_text_prompts_equal_transformers(llm, tiny_prompts, transformers_greedy, hf_texts):
    outputs = llm.generate([text_of(p) for p in tiny_prompts], SamplingParams(max_tokens=8))
    assert [o.prompt_token_ids for o in outputs] == tiny_prompts  # the same ids as the reference
    assert [o.outputs[0].token_ids for o in outputs] == transformers_greedy
    assert [o.outputs[0].text for o in outputs] == hf_texts
    assert [o.prompt for o in outputs] == [text_of(p) for p in tiny_prompts]


def test_token_prompts_a_mix_and_per_prompt_params(llm, tiny_prompts, transformers_greedy):
    mixed = [text_of(p) if i % 2 else {"prompt_token_ids": p} for i, p in enumerate(tiny_prompts)]
    params = [SamplingParams(max_tokens=1 + i % 4) for i in range(len(tiny_prompts))]
    outputs = llm.generate(mixed, params, use_tqdm=False)
    for i, output in enumerate(outputs):
        completion = output.outputs[0]
        assert completion.token_ids == transformers_greedy[i][: 1 + i % 4]
        assert output.prompt == (text_of(tiny_prompts[i]) if i % 2 else None)
    ids_only = llm.generate({"prompt_token_ids": tiny_prompts[1]}, use_tqdm=False)
    default = ids_only[0].outputs[0]  # SamplingParams(): 16 greedy tokens
    assert default.token_ids[:MAX_TOKENS] == transformers_greedy[1]
    assert (len(default.token_ids), default.finish_reason) == (16, "length")


def test_stop_strings_n_and_logprobs(llm, tiny_prompts, transformers_greedy, hf_texts):
    words = hf_texts[3].split()
    stop = words[2]  # ends the text before the third generated word
    out = llm.generate(text_of(tiny_prompts[3]), SamplingParams(max_tokens=8, stop=stop))
    completion = out[0].outputs[0]
    assert completion.text == hf_texts[3][: hf_texts[3].index(stop)]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)
    assert completion.token_ids == transformers_greedy[3][:3]
    sampled = llm.generate(
        {"prompt_token_ids": tiny_prompts[0]},
        SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=4, logprobs=2),
    )[0]
    assert [c.index for c in sampled.outputs] == [0, 1, 2]
    for c in sampled.outputs:
        assert len(c.logprobs) == len(c.token_ids) and all(
            t in lp for t, lp in zip(c.token_ids, c.logprobs, strict=True)
        )
        assert c.cumulative_logprob == pytest.approx(
            sum(lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs, strict=True))
        )


def test_chat_equals_the_server(llm, tiny_chat_dir):
    ours = llm.chat(CHAT, SamplingParams(max_tokens=MAX_TOKENS), use_tqdm=False)[0]
    answer = server_chat(llm, tiny_chat_dir, CHAT, MAX_TOKENS)
    choice = answer["choices"][0]
    assert ours.outputs[0].text == choice["message"]["content"]
    assert ours.outputs[0].finish_reason == choice["finish_reason"]
    assert len(ours.prompt_token_ids) == answer["usage"]["prompt_tokens"]
    expected = build_chat_tokenizer().apply_chat_template(CHAT, add_generation_prompt=True)
    assert ours.prompt_token_ids == expected["input_ids"]


@pytest.mark.parametrize(
    ("call", "error", "pattern"),
    [
        (lambda llm: llm.generate([3.5]), TypeError, r"prompts\[0\] must be a string"),
        (lambda llm: llm.generate({"prompt_ids": [1]}), TypeError, r"prompts\[0\] must be"),
        (lambda llm: llm.generate({"prompt_token_ids": [1, "2"]}), TypeError, r"list of ints"),
        (
            lambda llm: llm.generate(["<5>"], [SamplingParams()] * 2),
            ValueError,
            r"2 SamplingParams for 1",
        ),
        (
            lambda llm: llm.generate(["<5>"], {"max_tokens": 2}),
            TypeError,
            r"sampling_params must be",
        ),
        (
            lambda llm: llm.generate("<5> " * 70),
            ValueError,
            r"prompt 0 has 70 tokens; with max_model_len 64",
        ),
        (
            lambda llm: llm.generate({"prompt_token_ids": [500]}),
            ValueError,
            r"token id 500 outside \[0, 128\)",
        ),
        (  # issue 35 case 2: refused by its bytes, before it is tokenized
            lambda llm: llm.generate(["<5>", "<5> " * 5000]),
            ValueError,
            r"^prompt 1 has 20000 bytes of text; with max_model_len 64 .* at most 4032 bytes",
        ),
        (
            lambda llm: llm.chat([{"role": "user", "content": "<5> " * 5000}]),
            ValueError,
            r"^the conversation has \d+ bytes of text; with max_model_len 64",
        ),
        (
            lambda llm: llm.chat([{"role": "robot", "content": "x"}]),
            ValueError,
            r"messages\[0\]\.role must be",
        ),
        (lambda llm: llm.chat("hi"), TypeError, r"messages must be"),
    ],
)
def test_bad_input_is_refused_before_any_step(llm, call, error, pattern):
    num_steps = llm.llm_engine.observability.stats.num_steps
    with pytest.raises(error, match=pattern):
        call(llm)
    assert llm.llm_engine.observability.stats.num_steps == num_steps
    assert llm.llm_engine.num_running == llm.llm_engine.num_waiting == 0


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"temperature": -1}, ValueError, r"temperature must be a finite number >= 0"),
        ({"top_p": 0}, ValueError, r"top_p must be in \(0, 1\], got 0"),
        ({"n": 0}, ValueError, r"n must be an integer >= 1, got 0"),
        ({"stop": [""]}, ValueError, r"stop strings must be non-empty"),
        ({"logprobs": 21}, ValueError, r"logprobs must be in \[0, 20\], got 21"),
        ({"top_k": 5}, TypeError, r"unexpected keyword argument 'top_k'"),
    ],
)
def test_sampling_params_refuse(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"swap_space": 4}, TypeError, r"unexpected keyword argument 'swap_space'"),
        (
            {"gpu_memory_utilization": 1.5},
            ValueError,
            r"--gpu-memory-utilization must be in \(0, 1\], got 1.5",
        ),
        ({"max_num_seqs": "8"}, TypeError, r"max_num_seqs='8' must be int"),
        ({"max_num_seqs": 0}, ValueError, r"--max-num-seqs must be >= 1, got 0"),
        ({"tensor_parallel_size": 2}, ValueError, r"tensor_parallel_size=2 is not supported"),
        (
            {"distributed_executor_backend": "ray"},
            ValueError,
            r"distributed_executor_backend='ray'",
        ),
        (
            {"data_parallel_size": 2},
            ValueError,
            r"data_parallel_size=2 needs one process per DP rank",
        ),
        (
            {"distributed_executor_backend": "external_launcher"},
            ValueError,
            r"missing torchrun environment",
        ),
    ],
)
def test_llm_arguments_refuse(tiny_mixtral_dir, kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        LLM(tiny_mixtral_dir, **kwargs)


def test_text_without_tokenizer_names_the_missing_file(tiny_mixtral_dir):
    llm = LLM(tiny_mixtral_dir, dtype="float32", max_model_len=64, block_size=4)
    try:
        missing = re.escape(os.path.join(tiny_mixtral_dir, "tokenizer.json"))
        with pytest.raises(ValueError, match=rf"text prompts need a tokenizer and {missing} does"):
            llm.generate([{"prompt_token_ids": [5]}, "<5>"])
        with pytest.raises(ValueError, match=r"chat conversations need a tokenizer"):
            llm.chat(CHAT)
        assert llm.llm_engine.observability.stats.num_steps == 0
        assert llm.generate({"prompt_token_ids": [5, 6]})[0].outputs[0].text == ""
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def two_ranks(tiny_chat_dir, tiny_prompts, tmp_path_factory) -> list[dict]:
    """One torchrun run of tests/helpers/offline_ranks.py on 2 DP ranks (EP, DBO)."""
    out_dir = tmp_path_factory.mktemp("offline_ranks")
    proc = subprocess.run(
        torchrun_command(
            2, "tests.helpers.offline_ranks", tiny_chat_dir, str(out_dir), json.dumps(tiny_prompts)
        ),
        cwd=REPO,
        env={**os.environ, **TORCHRUN_ENV},
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
def test_two_dp_ranks_with_ep_and_dbo(
    two_ranks, llm, tiny_chat_dir, tiny_prompts, transformers_greedy, hf_texts
):
    for rank, result in enumerate(two_ranks):
        indices = range(rank, len(tiny_prompts), 2)  # each rank passed prompts[rank::2]
        assert result["num_ubatched_steps"] > 0  # DBO microbatched the steps
        for kind in ("text", "ids"):
            got = result[kind]
            assert [o["prompt_token_ids"] for o in got] == [tiny_prompts[i] for i in indices]
            assert [o["outputs"][0]["token_ids"] for o in got] == [
                transformers_greedy[i] for i in indices
            ]
            assert [o["outputs"][0]["text"] for o in got] == [hf_texts[i] for i in indices]
        for k, (i, o) in enumerate(zip(indices, result["per_prompt"], strict=True)):
            assert o["outputs"][0]["token_ids"] == transformers_greedy[i][: k + 1]
    server = server_chat(llm, tiny_chat_dir, CHAT, MAX_TOKENS)["choices"][0]["message"]
    assert all(r["chat"][0]["outputs"][0]["text"] == server["content"] for r in two_ranks)
    assert two_ranks[0]["one_rank_idle"][0]["outputs"][0]["token_ids"] == transformers_greedy[0]
    assert two_ranks[1]["one_rank_idle"] == []


@pytest.mark.slow
def test_bad_input_on_one_rank_raises_on_every_rank(two_ranks):
    rank0, rank1 = (r["bad_prompt"] for r in two_ranks)
    assert rank1["type"] == "TypeError" and rank1["message"].startswith("prompts[0] must be")
    assert rank0["type"] == "TypeError"
    assert rank0["message"] == f"DP rank 1: {rank1['message']}"
    assert rank0["num_steps"] == rank1["num_steps"] == 0


def test_the_example_script_runs_on_a_checkpoint_with_a_tokenizer(tiny_chat_dir):
    proc = subprocess.run(
        [
            sys.executable,
            "examples/offline_inference.py",
            f"--model={tiny_chat_dir}",
            "--max-tokens=4",
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("DP rank 0: prompt 'Hello, my name is' -> text '<") == 1, proc.stdout
    assert "DP rank 0: chat reply '<" in proc.stdout, proc.stdout


def test_launch_reexports_exactly_the_offline_api():
    """``launch`` lists the names itself (it must know them without importing torch): the two
    lists must not drift apart."""
    import launch
    import launch.offline

    assert launch.__all__ == launch.offline.__all__
    for name in launch.__all__:
        assert getattr(launch, name) is getattr(launch.offline, name)

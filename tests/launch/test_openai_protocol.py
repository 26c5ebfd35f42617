"""Completion request parsing, prompt checks, and incremental detokenization with stop strings."""

import pytest

from launch.serving.openai_protocol import ProtocolError, check_prompt_ids, parse_completion_request
from launch.text.detokenizer import IncrementalText


def test_defaults_and_vllm_extensions():
    r = parse_completion_request({"prompt": [[1, 2]]}, model_name="m")
    o = r.options
    assert r.prompts == ((1, 2),) and o.max_tokens == 16 and o.temperature == 1.0
    assert not o.stream and not r.return_token_ids and o.stop == () and o.n == 1
    assert r.logprobs is None and not r.echo and o.top_p == 1.0
    r = parse_completion_request(
        {
            "prompt": "hi",
            "model": "m",
            "stop": "x",
            "stop_token_ids": [7],
            "seed": 3,
            "ignore_eos": True,
            "return_token_ids": True,
            "stream": True,
            "top_p": 0.9,
            "n": 2,
            "logprobs": 3,
            "stream_options": {"include_usage": True},
        },
        model_name="m",
    )
    params = r.options.sampling_params(index=1, max_tokens=5, logprobs=r.logprobs)
    assert r.options.stop == ("x",) and params.stop_token_ids == (7,) and params.seed == 4
    assert params.ignore_eos and r.return_token_ids and r.options.stream and params.top_p == 0.9
    assert params.logprobs == 3 and params.max_tokens == 5 and r.options.include_usage


@pytest.mark.parametrize(
    ("prompt", "prompts"),
    [
        ("a b", ("a b",)),
        (["a", "b c"], ("a", "b c")),
        ([5, 6], ((5, 6),)),
        ([[5, 6], [7]], ((5, 6), (7,))),
    ],
)
def test_the_four_prompt_forms(prompt, prompts):
    assert parse_completion_request({"prompt": prompt}, model_name="m").prompts == prompts


@pytest.mark.parametrize(
    ("body", "pattern"),
    [
        ([1, 2], "must be a JSON object"),
        ({"prompt": [1, True]}, "list of token ids"),
        ({"prompt": ["a", [1]]}, "a list of token-id lists"),
        ({"prompt": [1], "n": 0}, r"'n' must be in \[1, 64\]"),
        ({"prompt": [[1]] * 33, "n": 2}, "33 prompts x n = 2 choices exceed"),
        ({"prompt": [1], "logprobs": 21}, r"'logprobs' must be in \[0, 20\]"),
        ({"prompt": [1], "top_p": 0}, r"'top_p' must be in \(0, 1\]"),
        ({"prompt": [1], "frequency_penalty": 0.5}, "'frequency_penalty' = 0.5 is not supported"),
        ({"prompt": [1], "logit_bias": {"5": 1}}, "'logit_bias' .* is not supported"),
        ({"prompt": [1], "max_tokens": "3"}, "'max_tokens' must be an integer"),
        ({"prompt": [1], "stream": 1}, "'stream' must be a boolean"),
        ({"prompt": [1], "stop": ["a"] * 5}, "up to 4"),
        ({"prompt": [1], "echo": True, "logprobs": 1}, "'echo' with 'logprobs'"),
    ],
)
def test_malformed_requests_name_the_field(body, pattern):
    with pytest.raises(ProtocolError, match=pattern) as info:
        parse_completion_request(body, model_name="m")
    assert info.value.status == 400


def test_prompt_must_leave_room_for_max_tokens():
    check_prompt_ids([1] * 8, max_tokens=8, vocab_size=10, max_model_len=16)
    with pytest.raises(ProtocolError, match="maximum context length is 16 tokens") as info:
        check_prompt_ids([1] * 9, max_tokens=8, vocab_size=10, max_model_len=16)
    assert info.value.param == "max_tokens"


class CharTokenizer:
    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def test_stop_string_split_over_tokens_is_held_back_then_cut():
    text = IncrementalText(CharTokenizer(), ("END",))
    assert text.add([ord("a"), ord("b")], is_last=False) == ""  # could start "END": held back
    assert text.add([ord("c")], is_last=False) == "a"
    assert text.add([ord("E"), ord("N")], is_last=False) == "bc"
    assert text.add([ord("D"), ord("z")], is_last=False) == ""
    assert text.stopped and text.text == "abc"


def test_without_stop_strings_everything_is_sent_and_incomplete_chars_wait():
    text = IncrementalText(CharTokenizer())
    assert text.add([ord("a"), 0xFFFD], is_last=False) == "a"
    assert text.add([ord("b")], is_last=True) == "\ufffdb"
    assert IncrementalText(None).add([1, 2], is_last=True) == ""

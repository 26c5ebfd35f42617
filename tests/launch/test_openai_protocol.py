"""Completion request parsing, prompt checks, and incremental detokenization with stop strings."""

import pytest

from launch.serving.detokenizer import IncrementalText
from launch.serving.openai_protocol import ProtocolError, check_prompt_ids, parse_completion_request


def test_defaults_and_vllm_extensions():
    r = parse_completion_request({"prompt": [[1, 2]]}, model_name="m")
    assert r.prompt == [1, 2] and r.max_tokens == 16 and r.temperature == 1.0
    assert not r.stream and not r.return_token_ids and r.stop == ()
    r = parse_completion_request(
        {"prompt": "hi", "model": "m", "stop": "x", "stop_token_ids": [7], "seed": 3,
         "ignore_eos": True, "return_token_ids": True, "stream": True, "top_p": 0.9},
        model_name="m",
    )  # fmt: skip
    params = r.sampling_params()
    assert r.stop == ("x",) and params.stop_token_ids == (7,) and params.seed == 3
    assert params.ignore_eos and r.return_token_ids and r.stream


@pytest.mark.parametrize(
    ("body", "pattern"),
    [
        ([1, 2], "must be a JSON object"),
        ({"prompt": [1, True]}, "list of token ids"),
        ({"prompt": ["a", "b"]}, "batch of 2 prompts"),
        ({"prompt": [1], "max_tokens": "3"}, "'max_tokens' must be an integer"),
        ({"prompt": [1], "stream": 1}, "'stream' must be a boolean"),
        ({"prompt": [1], "stop": ["a"] * 5}, "up to 4"),
        ({"prompt": [1], "echo": True}, "'echo' = True is not supported"),
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

"""Issue 35 case 2: a text prompt is bounded by bytes before it is tokenized (a 50 MB line reached
5.1 GiB per rank in the tokenizer). The bound never refuses a prompt that fits where it can be
derived (covering tokenizers), and is an assumed bytes-per-token where it cannot."""

from __future__ import annotations

import random

import pytest
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers, trainers

from launch.offline.prompts import ParsedPrompt, encode_prompts
from launch.text.text_bound import (
    ASSUMED_BYTES_PER_TOKEN,
    BytesPerToken,
    bytes_per_token,
    check_prompt_text,
)
from tests.helpers.chat import build_chat_tokenizer

CORPUS = [
    "the quick brown fox jumps over the lazy dog " * 3,
    "héllo wörld ñ 日本語 😀 " * 5,
    "    def f(x):\n        return x\n" * 4,
]
# texts the covering tokenizers are checked on: multi-byte characters, runs of spaces, characters
# NFC / NFKC shorten (e + combining acute, Hangul jamo, a mathematical A, a halfwidth katakana)
PIECES = [*"ab cdé日😀\n𝐀ｱ", "e\u0301", "\u1100\u1161\u11a8", "    ", "<|eot|>", "quick"]


def _byte_level_bpe() -> Tokenizer:
    """GPT-2 style (DeepSeek, Qwen2, OLMoE): NFC, ByteLevel, BPE."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=alphabet, special_tokens=["<|eot|>"]
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    return tokenizer


def _byte_fallback_bpe() -> Tokenizer:
    """Llama / Mixtral style: spaces replaced by ▁, BPE with byte fallback and fused unknowns."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    bytes_tokens = [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", *bytes_tokens])
    tokenizer.train_from_iterator(CORPUS, trainer)
    return tokenizer


@pytest.mark.parametrize("build", [_byte_level_bpe, _byte_fallback_bpe])
def test_a_covering_tokenizer_has_at_least_as_many_tokens_as_the_bound_says(build):
    tokenizer = build()
    bound = bytes_per_token(tokenizer)
    assert bound.is_derived
    rng = random.Random(0)
    for _ in range(1000):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(1, 60)))
        num_tokens = len(tokenizer.encode(text, add_special_tokens=False).ids)
        assert num_tokens * bound.num_bytes >= len(text.encode()), text


def test_the_bound_counts_a_byte_level_character_as_one_byte_and_scales_by_the_normalizer():
    tokenizer = _byte_level_bpe()
    longest = max(map(len, tokenizer.get_vocab(with_added_tokens=False)))
    assert bytes_per_token(tokenizer).num_bytes == 4 * longest  # NFC may shorten text 4x
    tokenizer.normalizer = None
    assert bytes_per_token(tokenizer).num_bytes == max(longest, len("<|eot|>"))


def _whitespace_bpe() -> Tokenizer:
    tokenizer = _byte_fallback_bpe()
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return tokenizer


def _stripping_normalizer() -> Tokenizer:
    tokenizer = _byte_level_bpe()
    tokenizer.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Strip()])
    return tokenizer


def _lstrip_added_token() -> Tokenizer:
    tokenizer = _byte_level_bpe()
    tokenizer.add_special_tokens([AddedToken("<mask>", lstrip=True)])
    return tokenizer


def _fused_unknowns() -> Tokenizer:
    return Tokenizer(models.BPE({"a": 0, "<unk>": 1}, [], unk_token="<unk>", fuse_unk=True))


@pytest.mark.parametrize(
    "build",
    [
        lambda: build_chat_tokenizer()._tokenizer,  # WordLevel over WhitespaceSplit
        _whitespace_bpe,
        _stripping_normalizer,
        _lstrip_added_token,
        _fused_unknowns,
    ],
    ids=["word_level", "whitespace", "strip", "lstrip_added_token", "fused_unknowns"],
)
def test_a_tokenizer_that_can_drop_text_gets_the_assumed_bound(build):
    bound = bytes_per_token(build())
    assert not bound.is_derived and bound.num_bytes >= ASSUMED_BYTES_PER_TOKEN, bound


def test_why_no_bound_exists_for_a_whitespace_tokenizer():
    tokenizer = build_chat_tokenizer()._tokenizer
    assert len(tokenizer.encode(" " * 100_000 + "<5>", add_special_tokens=False).ids) == 1


class _RefusingTokenizer:
    """A tokenizer whose bound is 4 bytes per token and which must never be asked to encode."""

    bytes_per_token = BytesPerToken(num_bytes=4, is_derived=True)

    def encode(self, text: str) -> list[int]:
        raise AssertionError(f"encoded a text of {len(text)} characters")


def test_a_text_over_the_bound_is_refused_before_tokenizing_naming_its_index_and_size():
    tokenizer = _RefusingTokenizer()  # max_model_len 11: at most 10 tokens, 40 bytes
    check_prompt_text("a" * 40, "prompt 0", max_model_len=11, tokenizer=tokenizer)
    check_prompt_text("é" * 20, "prompt 0", max_model_len=11, tokenizer=tokenizer)  # 40 bytes
    with pytest.raises(ValueError, match=r"^prompt 0 has 42 bytes of text; .* at most 40 bytes"):
        check_prompt_text("é" * 21, "prompt 0", max_model_len=11, tokenizer=tokenizer)
    prompts = [ParsedPrompt(text=None, token_ids=(1,)), ParsedPrompt(text="a" * 41, token_ids=None)]
    with pytest.raises(ValueError, match=r"^prompt 1 has 41 bytes of text; with max_model_len 11"):
        encode_prompts(prompts, tokenizer, None, max_model_len=11)

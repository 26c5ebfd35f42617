"""The most bytes of text a prompt that fits the context can hold, so that a longer text is refused
before it is tokenized (``check_prompt_text``: ``launch.generate``, the offline API and the
server), from the tokenizer's longest token (``bytes_per_token``). The derivation, and the
tokenizers without a bound: docs/serving.md#text-bound-the-derivation."""

from __future__ import annotations

import json
from dataclasses import dataclass

# Bytes of text per token assumed where no bound can be derived (see the module docstring).
ASSUMED_BYTES_PER_TOKEN = 64
# Most bytes of one character of UTF-8, and how many times shorter (in bytes) a Unicode
# normalization form or lowercasing can make a text.
MAX_CHAR_BYTES = 4
_UNICODE_NORMALIZERS = frozenset({"NFC", "NFD", "NFKC", "NFKD", "Lowercase"})
_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Digits", "UnicodeScripts"})


@dataclass(frozen=True, slots=True, kw_only=True)
class BytesPerToken:
    """The most bytes of text one token of a tokenizer stands for: derived (``is_derived``), or
    ``ASSUMED_BYTES_PER_TOKEN`` for a tokenizer that can drop text or fold a word into a token."""

    num_bytes: int
    is_derived: bool

    def max_text_bytes(self, max_model_len: int) -> int:
        """The most bytes of text a prompt of at most ``max_model_len - 1`` tokens holds."""
        return max(max_model_len - 1, 0) * self.num_bytes


def _state(component) -> dict | None:
    return None if component is None else json.loads(component.__getstate__())


def _normalizer_shrink(spec: dict | None) -> int | None:
    """How many times fewer bytes the normalizer can leave of a text; None: no bound."""
    if spec is None:
        return 1
    kind = spec["type"]
    if kind == "Sequence":
        factors = [_normalizer_shrink(item) for item in spec["normalizers"]]
        if None in factors:
            return None
        product = 1
        for factor in factors:
            product *= factor
        return product
    if kind in _UNICODE_NORMALIZERS:
        return MAX_CHAR_BYTES
    if kind in ("Prepend", "ByteLevel"):
        return 1
    if kind == "Replace" and "String" in spec["pattern"]:
        num_pattern = len(spec["pattern"]["String"].encode())
        num_content = len(spec["content"].encode())
        return None if num_content == 0 else max(1, -(-num_pattern // num_content))
    return None  # Strip, StripAccents, BertNormalizer, Nmt, Precompiled, a regex Replace


def _pre_tokenizers(spec: dict | None) -> list[dict]:
    if spec is None:
        return []
    if spec["type"] == "Sequence":
        return [item for inner in spec["pretokenizers"] for item in _pre_tokenizers(inner)]
    return [spec]


def _keeps_every_character(spec: dict) -> bool:
    if spec["type"] in ("Split", "Punctuation"):
        return spec.get("behavior") != "Removed"
    return spec["type"] in _KEEPING_PRE_TOKENIZERS


def _model_covers(hf_tokenizer, vocab: dict[str, int], is_byte_level: bool) -> bool:
    """Whether the model gives every character of a pre-token a token of its own vocabulary."""
    model = hf_tokenizer.model
    kind = type(model).__name__
    if kind == "BPE":
        if model.byte_fallback:
            return True
        if is_byte_level:
            from tokenizers.pre_tokenizers import ByteLevel

            return all(c in vocab for c in ByteLevel.alphabet())
        return model.unk_token is not None and not model.fuse_unk
    if kind == "Unigram":  # unknown characters are fused into one unknown token
        return bool(_state(model).get("byte_fallback"))
    return False  # WordLevel, WordPiece: an unknown word is one token


def bytes_per_token(hf_tokenizer) -> BytesPerToken:
    """The bound of a ``tokenizers.Tokenizer`` (read once, when the tokenizer is loaded)."""
    pre_tokenizers = _pre_tokenizers(_state(hf_tokenizer.pre_tokenizer))
    is_byte_level = any(p["type"] == "ByteLevel" for p in pre_tokenizers)
    vocab = hf_tokenizer.get_vocab(with_added_tokens=False)
    added = list(hf_tokenizer.get_added_tokens_decoder().values())
    if is_byte_level:  # each character of an entry is one byte of text
        longest = max(map(len, vocab), default=0)
    else:
        longest = max((len(t.encode("utf-8", "surrogatepass")) for t in vocab), default=0)
    longest = max(longest, *(len(t.content.encode()) for t in added), MAX_CHAR_BYTES)
    shrink = _normalizer_shrink(_state(hf_tokenizer.normalizer))
    is_covering = (
        shrink is not None
        and all(map(_keeps_every_character, pre_tokenizers))
        and _model_covers(hf_tokenizer, vocab, is_byte_level)
        and not any(t.lstrip or t.rstrip for t in added)
    )
    if not is_covering:
        return BytesPerToken(num_bytes=max(ASSUMED_BYTES_PER_TOKEN, longest), is_derived=False)
    return BytesPerToken(num_bytes=shrink * longest, is_derived=True)


def check_prompt_text(text: str, where: str, *, max_model_len: int, tokenizer) -> None:
    """Refuse, before tokenizing it, a text with more bytes than any prompt that fits.

    ``where`` names the prompt (``prompt 3``); ``tokenizer`` has a ``bytes_per_token``
    (``launch.text.detokenizer.Tokenizer``). Costs at most one UTF-8 copy of ``text``.

    Raises:
        ValueError: one line naming ``where``, its size and the bound.
    """
    bound: BytesPerToken = tokenizer.bytes_per_token
    max_bytes = bound.max_text_bytes(max_model_len)
    if len(text) * MAX_CHAR_BYTES <= max_bytes:  # within the bound whatever its characters
        return
    num_bytes = len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
    if num_bytes <= max_bytes:
        return
    num_tokens = max(max_model_len - 1, 0)
    why = (
        f"{num_tokens} tokens of at most {bound.num_bytes} bytes of text each with this tokenizer"
        if bound.is_derived
        else f"{num_tokens} tokens of {bound.num_bytes} bytes each, assumed: this tokenizer can "
        "drop text or fold a word into one token"
    )
    raise ValueError(
        f"{where} has {num_bytes} bytes of text; with max_model_len {max_model_len} "
        f"(--max-model-len) a prompt holds at most {max_bytes} bytes ({why}); refused before "
        "tokenizing"
    )

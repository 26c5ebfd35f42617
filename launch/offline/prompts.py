"""Prompts of the offline API, as vLLM takes them (``vllm/inputs/data.py``): a string, a
``TextPrompt`` ``{"prompt": str}`` or a ``TokensPrompt`` ``{"prompt_token_ids": [int, ...]}``,
alone or in a list (a mix is fine); and their checks against the model."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict


class TextPrompt(TypedDict):
    prompt: str


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]


@dataclass(frozen=True, slots=True, kw_only=True)
class ParsedPrompt:
    """One prompt: its text (None for token ids) and its token ids (None until encoded)."""

    text: str | None
    token_ids: tuple[int, ...] | None


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_prompt(prompt, index: int) -> ParsedPrompt:
    """Check one prompt's type.

    Raises:
        TypeError: naming ``prompts[index]`` if it is not a string, ``{"prompt": str}`` or
            ``{"prompt_token_ids": [int, ...]}`` (unknown keys are refused, not ignored).
    """
    where = f"prompts[{index}]"
    if isinstance(prompt, str):
        return ParsedPrompt(text=prompt, token_ids=None)
    if isinstance(prompt, dict):
        keys = set(prompt)
        if keys == {"prompt"} and isinstance(prompt["prompt"], str):
            return ParsedPrompt(text=prompt["prompt"], token_ids=None)
        ids = prompt.get("prompt_token_ids")
        if keys == {"prompt_token_ids"} and isinstance(ids, (list, tuple)):
            if all(_is_int(t) for t in ids):
                return ParsedPrompt(text=None, token_ids=tuple(ids))
            raise TypeError(f"{where}['prompt_token_ids'] must be a list of ints")
    raise TypeError(
        f"{where} must be a string, {{'prompt': str}} or {{'prompt_token_ids': [int, ...]}}, "
        f"got {_short(prompt)}"
    )


def parse_prompts(prompts) -> list[ParsedPrompt]:
    """``prompts`` (one prompt or a list of them) parsed; TypeError naming the first bad one."""
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(
            f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}"
        )
    return [parse_prompt(p, i) for i, p in enumerate(prompts)]


def missing_tokenizer_error(model_dir: str | None, what: str) -> ValueError:
    """The one-line error for ``what`` (text prompts, chat) without a tokenizer: names the file."""
    if model_dir is None:
        where = "the embedded default model has no tokenizer"
    else:
        where = f"{Path(model_dir) / 'tokenizer.json'} does not exist"
    return ValueError(f"{what} need a tokenizer and {where}; pass token ids instead")


def check_prompt_ids(token_ids, index: int, *, vocab_size: int, max_model_len: int) -> None:
    """Raise ValueError naming prompt ``index`` if it is empty, too long to generate a token
    within ``max_model_len``, or has a token id outside ``[0, vocab_size)``."""
    if not token_ids:
        raise ValueError(f"prompt {index} is empty")
    if len(token_ids) >= max_model_len:
        raise ValueError(
            f"prompt {index} has {len(token_ids)} tokens; with max_model_len {max_model_len} "
            f"(--max-model-len) prompts must have at most {max_model_len - 1} tokens"
        )
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"prompt {index} has token id {bad} outside [0, {vocab_size})")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."

"""Prompts of the offline API, as vLLM takes them (``vllm/inputs/data.py``): a string, a
``TextPrompt`` ``{"prompt": str}`` or a ``TokensPrompt`` ``{"prompt_token_ids": [int, ...]}``,
alone or in a list (a mix is fine); and their checks against the model."""

from __future__ import annotations

import json
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


def parse_prompt(prompt, where: str) -> ParsedPrompt:
    """Check one prompt's type (``where`` names it in errors, e.g. ``prompts[3]``).

    Raises:
        TypeError: if it is not a string, ``{"prompt": str}`` or
            ``{"prompt_token_ids": [int, ...]}`` (unknown keys are refused, not ignored).
    """
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
    return [parse_prompt(p, f"prompts[{i}]") for i, p in enumerate(prompts)]


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


def check_prompts(token_id_lists, *, vocab_size: int, max_model_len: int) -> None:
    """``check_prompt_ids`` on each prompt; ValueError naming the first bad one."""
    for index, token_ids in enumerate(token_id_lists):
        check_prompt_ids(token_ids, index, vocab_size=vocab_size, max_model_len=max_model_len)


def encode_prompts(
    prompts: list[ParsedPrompt], tokenizer, tokenizer_dir: str | None, *, max_model_len: int
) -> list[ParsedPrompt]:
    """``prompts`` with every text encoded (with the tokenizer's special tokens, as vLLM does),
    each text first checked to be short enough to fit ``max_model_len`` (``check_prompt_text``).

    Raises:
        ValueError: a text prompt and no tokenizer (naming the missing ``tokenizer.json``), or a
            text with more bytes than any prompt that fits (naming its index and size).
    """
    if tokenizer is None:
        if any(p.token_ids is None for p in prompts):
            raise missing_tokenizer_error(tokenizer_dir, "text prompts")
        return prompts
    from launch.text.text_bound import check_prompt_text

    for index, p in enumerate(prompts):
        if p.token_ids is None:
            where = f"prompt {index}"
            check_prompt_text(p.text, where, max_model_len=max_model_len, tokenizer=tokenizer)
    return [
        p
        if p.token_ids is not None
        else ParsedPrompt(text=p.text, token_ids=tuple(tokenizer.encode(p.text)))
        for p in prompts
    ]


def read_prompts(path: str, *, allow_text: bool = True) -> list[ParsedPrompt]:
    """JSONL lines ``{"prompt": "text"}`` or ``{"prompt_token_ids": [int, ...]}`` (blank lines
    skipped); text lines only if ``allow_text``.

    Raises:
        ValueError: naming the file and line of a malformed entry (or a text one where not
            allowed), or an empty file.
        OSError: if the file cannot be read.
    """
    expected = (
        "{'prompt': str} or {'prompt_token_ids': [int, ...]}"
        if allow_text
        else "{'prompt_token_ids': [int, ...]}"
    )
    prompts: list[ParsedPrompt] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                entry = _load_json_line(line)
                if not isinstance(entry, dict):
                    raise TypeError(f"got {_short(entry)}")
                prompt = parse_prompt(entry, "the entry")
            except (json.JSONDecodeError, TypeError) as e:
                raise ValueError(
                    f"{path}:{lineno}: expected a JSON object {expected} ({e})"
                ) from None
            if prompt.token_ids is None and not allow_text:
                raise ValueError(
                    f"{path}:{lineno}: expected a JSON object {expected} (a text prompt)"
                )
            prompts.append(prompt)
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def _load_json_line(line: str):
    """``json.loads(line)``; any failure as a JSONDecodeError (one line): nesting too deep for
    json's recursive decoder (RecursionError), or an int past Python's digit limit (ValueError)."""
    try:
        return json.loads(line)
    except RecursionError:
        raise json.JSONDecodeError("JSON nested too deeply", line[:0], 0) from None
    except json.JSONDecodeError:
        raise
    except ValueError as e:  # int digit limit
        raise json.JSONDecodeError(str(e)[:200], line[:0], 0) from None


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."

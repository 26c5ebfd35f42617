"""The checkpoint's tokenizer (if it has one) and incremental detokenization with stop strings.

The tokenizer is read from ``tokenizer.json`` in the checkpoint directory with Hugging Face's
``tokenizers`` library (the file every fast tokenizer is saved as). Without it the server takes
prompts as token ids only and answers with empty ``text`` (``return_token_ids`` gives the ids).
"""

from __future__ import annotations

from pathlib import Path

# Inputs at least this long (characters, or token ids) go through the ``tokenizers`` batch calls,
# which release the GIL (the single-item calls hold it for the whole input), so that the HTTP
# event loop keeps running while another thread tokenizes.
LARGE_INPUT = 4096


class Tokenizer:
    """``encode(text) -> ids`` (with the checkpoint's special tokens) and ``decode(ids) -> text``.

    Thread-safe; large inputs release the GIL (``LARGE_INPUT``), so the server runs them in an
    executor (``launch.serving.serving_engine.OpenAIServing.offload``).
    """

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        from launch.text.text_bound import bytes_per_token

        self._tokenizer = HFTokenizer.from_file(str(path))
        # the most bytes of text a token stands for: bounds a prompt's text before it is encoded
        self.bytes_per_token = bytes_per_token(self._tokenizer)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; a rendered chat template already holds its special tokens, so
        it is encoded with ``add_special_tokens=False`` (as vLLM and transformers do)."""
        if len(text) < LARGE_INPUT:
            return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        batch = self._tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)
        return batch[0].ids

    def token_text(self, token_id: int) -> str:
        """One token's text, special tokens included (how logprobs name tokens)."""
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def decode(self, token_ids: list[int]) -> str:
        if len(token_ids) < LARGE_INPUT:
            return self._tokenizer.decode(token_ids, skip_special_tokens=True)
        return self._tokenizer.decode_batch([token_ids], skip_special_tokens=True)[0]


def load_tokenizer(model_dir: str | None) -> Tokenizer | None:
    """The tokenizer of ``model_dir`` if it has a ``tokenizer.json``, else None.

    Raises:
        ValueError: if ``tokenizer.json`` exists but cannot be read (naming the file).
    """
    if model_dir is None:
        return None
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        return Tokenizer(path)
    except Exception as e:  # noqa: BLE001 - tokenizers raises its own exception type
        raise ValueError(f"{path}: cannot load the tokenizer ({e})") from None


class IncrementalText:
    """The text of a growing list of generated tokens, cut at the first stop string.

    ``add`` returns the new text that is safe to send: text that could still turn out to be the
    start of a stop string, or an incomplete UTF-8 character (decoded as U+FFFD), is held back
    until the next tokens or the last output (as vLLM's detokenizer does).
    """

    def __init__(self, tokenizer: Tokenizer | None, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.token_ids: list[int] = []
        self.text = ""  # text sent so far
        self.stopped = False  # a stop string matched: generation must end here

    def add(self, new_token_ids, *, is_last: bool) -> str:
        self.token_ids += new_token_ids
        if self.tokenizer is None or self.stopped:
            return ""
        full = self.tokenizer.decode(self.token_ids)
        hits = [i for stop in self.stop if (i := full.find(stop)) >= 0]
        if hits:  # the earliest match of any stop string ends the text
            full, self.stopped = full[: min(hits)], True
        safe = len(full)
        if not (is_last or self.stopped):
            if self.stop:
                safe -= max(len(s) for s in self.stop) - 1
            while safe > 0 and full[safe - 1] == "\ufffd":
                safe -= 1
        safe = max(safe, len(self.text))
        delta = full[len(self.text) : safe]
        self.text += delta
        return delta

"""A transformers-built tokenizer with a chat template for the tiny checkpoints (vocabulary of
128 words ``<i>``), saved next to a checkpoint as ``save_pretrained`` writes it."""

from __future__ import annotations

from pathlib import Path

# Multi-line, with blocks on their own lines: trim_blocks / lstrip_blocks decide the whitespace.
# Role markers are vocabulary words, so every rendered prompt encodes to known token ids.
CHAT_TEMPLATE = """{{ bos_token }}
{% for message in messages %}
    {% if message['role'] == 'tool' %}
        {{ raise_exception('tool messages are not supported by this template') }}
    {% endif %}
    {% if message['role'] == 'system' %}<3> {% elif message['role'] == 'user' %}<4> \
{% else %}<5> {% endif %}
{{ message['content'] | trim }} {{ eos_token }}
{% endfor %}
{% if add_generation_prompt %}
<5> {% endif %}"""

BOS_TOKEN, EOS_TOKEN, UNK_TOKEN = "<1>", "<2>", "<0>"


def build_chat_tokenizer(chat_template: str = CHAT_TEMPLATE):
    """transformers' ``PreTrainedTokenizerFast`` over a WordLevel model: token ``i`` is ``<i>``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<{i}>": i for i in range(128)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=UNK_TOKEN))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN, unk_token=UNK_TOKEN
    )
    fast.chat_template = chat_template
    return fast


def checkpoint_with_chat_tokenizer(checkpoint_dir: str, path: Path) -> str:
    """``path`` with ``checkpoint_dir``'s files linked in and the chat tokenizer saved there."""
    path.mkdir(parents=True, exist_ok=True)
    for item in Path(checkpoint_dir).iterdir():
        (path / item.name).symlink_to(item)
    build_chat_tokenizer().save_pretrained(str(path))
    return str(path)

"""Text in and out of the engine, shared by the offline API and the server: the checkpoint's
tokenizer and incremental detokenization with stop strings (``detokenizer``), chat messages
checked (``chat_messages``) and rendered by the checkpoint's chat template (``chat_template``),
and the bytes bound that refuses a too-long text before it is tokenized (``text_bound``)."""

from launch.text.chat_messages import ROLES, parse_message
from launch.text.chat_template import ChatTemplate, ChatTemplateError, load_chat_template
from launch.text.detokenizer import IncrementalText, Tokenizer, load_tokenizer
from launch.text.text_bound import BytesPerToken, bytes_per_token, check_prompt_text

__all__ = [
    "ROLES",
    "BytesPerToken",
    "ChatTemplate",
    "ChatTemplateError",
    "IncrementalText",
    "Tokenizer",
    "bytes_per_token",
    "check_prompt_text",
    "load_chat_template",
    "load_tokenizer",
    "parse_message",
]

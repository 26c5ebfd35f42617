"""``LLM.chat``'s conversations rendered into prompts the way the server's chat completions
render them: each message checked by ``launch.text.chat_messages.parse_message``, the
conversation rendered by ``launch.text.chat_template.ChatTemplate`` and encoded without
adding special tokens (the template holds them)."""

from __future__ import annotations

from launch.offline.prompts import ParsedPrompt, missing_tokenizer_error
from launch.text.chat_messages import parse_message
from launch.text.chat_template import ChatTemplate
from launch.text.text_bound import check_prompt_text


def conversations(messages) -> list[list]:
    """``messages`` as a list of conversations: one conversation (a list of message dicts) or
    a list of them. Raises TypeError otherwise."""
    if isinstance(messages, (list, tuple)) and messages:
        if all(isinstance(m, dict) for m in messages):
            return [list(messages)]
        if all(isinstance(c, (list, tuple)) and c for c in messages):
            return [list(c) for c in messages]
    raise TypeError(
        "messages must be a non-empty list of message dicts (one conversation) or a list of "
        f"non-empty conversations, got {type(messages).__name__}"
    )


def render_conversations(
    offline_model,
    messages,
    *,
    chat_template: str | None,
    add_generation_prompt: bool,
    chat_template_kwargs: dict | None,
) -> list[ParsedPrompt]:
    """Each conversation's rendered text and its token ids.

    Raises:
        ValueError: no tokenizer (naming the missing file), no chat template, a malformed
            message (``messages[i]`` named, ``conversation k`` when there are several), the
            template failing on the messages, or a rendered text too long to fit (refused before
            it is tokenized).
        TypeError: ``messages`` of the wrong shape.
    """
    tokenizer = offline_model.tokenizer
    if tokenizer is None:
        raise missing_tokenizer_error(offline_model.tokenizer_dir, "chat conversations")
    template = offline_model.chat_template
    if chat_template is not None:
        special = {} if template is None else template.special_tokens
        template = ChatTemplate(chat_template, special_tokens=special, origin="chat_template")
    if template is None:
        raise ValueError(
            f"{offline_model.tokenizer_dir}: no chat template (tokenizer_config.json "
            "'chat_template' or chat_template.jinja); pass chat_template='...' (jinja2)"
        )
    convs = conversations(messages)
    prompts = []
    for k, conversation in enumerate(convs):
        try:
            checked = [parse_message(i, m) for i, m in enumerate(conversation)]
            text = template.render(
                checked,
                add_generation_prompt=add_generation_prompt,
                variables=chat_template_kwargs,
            )
        except ValueError as e:
            raise ValueError(f"conversation {k}: {e}" if len(convs) > 1 else str(e)) from None
        where = f"conversation {k}" if len(convs) > 1 else "the conversation"
        max_model_len = offline_model.resolved.max_model_len
        check_prompt_text(text, where, max_model_len=max_model_len, tokenizer=tokenizer)
        token_ids = tuple(tokenizer.encode(text, add_special_tokens=False))
        prompts.append(ParsedPrompt(text=text, token_ids=token_ids))
    return prompts

"""Chat messages checked before a chat template renders them (the server's chat completions and
``LLM.chat`` alike): OpenAI's roles, and content as a string or a list of ``{"type": "text"}``
parts, joined with newlines as vLLM does for string templates."""

from __future__ import annotations

ROLES = ("system", "developer", "user", "assistant", "tool")


def parse_message(index: int, message) -> dict:
    """``messages[index]`` checked (a role of ``ROLES``; content a string, None or text parts,
    joined with newlines); a copy with the joined content.

    Raises:
        ValueError: naming ``messages[index]`` and what is wrong with it.
    """
    where = f"messages[{index}]"
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ValueError(f"{where} must be an object with a 'role' string")
    if message["role"] not in ROLES:
        raise ValueError(f"{where}.role must be one of {', '.join(ROLES)}, got {message['role']!r}")
    content = message.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" for p in content) or not all(
            isinstance(p.get("text"), str) for p in content
        ):
            raise ValueError(
                f"{where}.content: only text parts ({{'type': 'text', 'text': ...}}) are supported"
            )
        content = "\n".join(p["text"] for p in content)
    elif content is not None and not isinstance(content, str):
        raise ValueError(f"{where}.content must be a string or a list of text parts")
    return {**message, "content": content}

"""The checkpoint's chat template, rendered with jinja2 exactly as transformers renders it
(``ChatTemplate``, ``load_chat_template``). Where the template comes from and the rendering
environment: docs/serving.md#chat-template-where-it-comes-from-how-it-renders."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class ChatTemplateError(ValueError):
    """The template could not be rendered for these messages (its ``raise_exception`` or a jinja
    error): the client's request is answered 400 with this message."""


def _token_content(value) -> str | None:
    """A special token as tokenizer_config.json saves it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _compile(source: str):
    """``source`` compiled in the environment transformers renders chat templates in
    (``_compile_jinja_template`` in ``transformers/utils/chat_template_utils.py``).

    Raises:
        jinja2.TemplateError: ``source`` is not a valid jinja2 template.
    """
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    extensions = [_generation_tag_extension(), jinja2.ext.loopcontrols]
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=extensions)
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _template_namespace_class()
    return env.from_string(source)


def _generation_tag_extension():
    """The jinja2 extension of ``{% generation %}...{% endgeneration %}``: it renders its body
    (transformers tracks the span for assistant masks; rendering is the same)."""
    import jinja2.ext

    class GenerationTag(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(
                lineno
            )

        def _render(self, caller):
            return caller()

    return GenerationTag


def _template_namespace_class():
    """jinja2's ``namespace`` refusing underscore-prefixed attributes (SecurityError), as
    transformers restricts it."""
    import jinja2

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):  # jinja's signature trick, so namespace(self=...) works
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates cannot set underscore-prefixed attributes, got {name!r}"
                )

    return TemplateNamespace


class _TemplateDict:
    """The templates' ``dict``: calling it and ``dict.fromkeys`` only."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message):
    """The templates' ``raise_exception``: a TemplateError with ``message``."""
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """The templates' ``tojson`` filter: ``json.dumps`` without jinja's HTML escaping."""
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class ChatTemplate:
    """A compiled chat template and the special tokens it may refer to.

    Raises:
        ValueError: if ``source`` is not a valid jinja2 template (naming ``origin``).
    """

    def __init__(self, source: str, *, special_tokens: dict[str, str], origin: str) -> None:
        import jinja2

        try:
            self._template = _compile(source)
        except jinja2.TemplateError as e:
            raise ValueError(f"{origin}: not a valid jinja2 chat template ({e})") from None
        self.special_tokens = special_tokens
        self.origin = origin

    def render(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool = True,
        variables: dict | None = None,
    ) -> str:
        """The prompt text of ``messages`` (OpenAI message dicts); ``variables`` are extra
        template variables (vLLM's ``chat_template_kwargs``, e.g. ``enable_thinking``).

        Raises:
            ChatTemplateError: the template refused the messages or failed on them.
        """
        import jinja2

        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        variables = {  # the request's kwargs may add variables, never replace these
            **self.special_tokens,
            **(variables or {}),
            "messages": messages,
            "tools": None,
            "documents": None,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return self._template.render(**variables)
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError) as e:
            raise ChatTemplateError(f"the chat template failed on these messages: {e}") from None


def load_chat_template(model_dir: str | None, template_path: str | None) -> ChatTemplate | None:
    """The chat template of ``--chat-template`` or of the checkpoint; None if it has none.

    Raises:
        OSError: ``template_path`` cannot be read.
        ValueError: tokenizer_config.json is not valid JSON, or the template does not compile.
    """
    config: dict = {}
    config_path = None if model_dir is None else Path(model_dir) / "tokenizer_config.json"
    if config_path is not None and config_path.is_file():
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{config_path}: not valid JSON ({e})") from None
    special = {name: t for name in SPECIAL_TOKEN_NAMES if (t := _token_content(config.get(name)))}
    if template_path is not None:
        path = Path(template_path)
        if not path.is_file():
            raise FileNotFoundError(f"--chat-template {template_path}: no such file")
        return ChatTemplate(
            path.read_text(encoding="utf-8"), special_tokens=special, origin=str(path)
        )
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: transformers picks "default"
        source = next((t.get("template") for t in source if t.get("name") == "default"), None)
    if isinstance(source, str):
        return ChatTemplate(source, special_tokens=special, origin=str(config_path))
    jinja_path = None if model_dir is None else Path(model_dir) / "chat_template.jinja"
    if jinja_path is not None and jinja_path.is_file():
        return ChatTemplate(
            jinja_path.read_text(encoding="utf-8"), special_tokens=special, origin=str(jinja_path)
        )
    return None

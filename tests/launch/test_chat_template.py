"""Chat templates render exactly as transformers' ``apply_chat_template`` (a tokenizer built and
saved by transformers offline), and the chat request is parsed and checked."""

from __future__ import annotations

import json
import re

import pytest

from launch.serving.chat_protocol import parse_chat_request
from launch.serving.openai_protocol import ProtocolError
from launch.text.chat_template import ChatTemplateError, load_chat_template
from launch.text.detokenizer import load_tokenizer
from tests.helpers.chat import CHAT_TEMPLATE, build_chat_tokenizer

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n'"
    " }}{% endif %}"
)
# namespace, loop controls, tojson, the generation tag, a default system prompt: features that
# Hub templates (Llama 3, Qwen, ...) use.
RICH = """{%- set ns = namespace(system='You are helpful.', n=0) -%}
{%- for m in messages -%}
  {%- if m.role == 'system' -%}{%- set ns.system = m.content -%}{%- continue -%}{%- endif -%}
  {%- set ns.n = ns.n + 1 -%}
{%- endfor -%}
{{ bos_token }}[SYS {{ ns.system | tojson }}] turns={{ ns.n }}
{% for m in messages if m.role != 'system' %}
  {% if m.role == 'assistant' %}{% generation %}A: {{ m.content }}{% endgeneration %}{{ eos_token }}
  {% else %}U: {{ m.content }}
  {% endif %}
{% endfor %}
{% if add_generation_prompt %}A:{% endif %}"""

CONVERSATIONS = [
    [{"role": "user", "content": "<7> <8>"}],
    [
        {"role": "system", "content": "<9>"},
        {"role": "user", "content": " <10> <11> "},
        {"role": "assistant", "content": "<12>"},
        {"role": "user", "content": "<13> <14>"},
    ],
    [{"role": "user", "content": 'quotes " and <b>ünï</b>', "name": None}],
]


@pytest.mark.parametrize("template", [CHAT_TEMPLATE, CHATML, RICH], ids=["word", "chatml", "rich"])
@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["one", "multi", "escapes"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_renders_exactly_as_transformers(tmp_path, template, messages, add_generation_prompt):
    hf = build_chat_tokenizer(template)
    hf.save_pretrained(str(tmp_path))  # transformers 5 writes chat_template.jinja
    ours = load_chat_template(str(tmp_path), None)
    expected = hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours.render(messages, add_generation_prompt=add_generation_prompt) == expected


def test_token_ids_equal_transformers(tmp_path):
    hf = build_chat_tokenizer()
    hf.save_pretrained(str(tmp_path))
    messages = CONVERSATIONS[1]
    text = load_chat_template(str(tmp_path), None).render(messages)
    ids = load_tokenizer(str(tmp_path)).encode(text, add_special_tokens=False)
    assert ids == hf.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    assert ids[0] == 1 and ids[-1] == 5  # bos_token from the config, the generation prompt


def test_template_from_tokenizer_config_and_from_a_file(tmp_path):
    config = {
        "bos_token": {"content": "<1>", "special": True},
        "eos_token": "<2>",
        "chat_template": [
            {"name": "tool_use", "template": "T"},
            {"name": "default", "template": "{{ bos_token }}D{{ eos_token }}"},
        ],
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_chat_template(str(tmp_path), None).render([]) == "<1>D<2>"
    file = tmp_path / "t.jinja"
    file.write_text("F{{ messages | length }}{{ eos_token }}")
    assert load_chat_template(str(tmp_path), str(file)).render([{"role": "user"}]) == "F1<2>"
    assert load_chat_template(str(tmp_path / "nothing"), None) is None
    assert load_chat_template(None, None) is None


def test_raise_exception_and_bad_templates_are_clear_errors(tmp_path):
    build_chat_tokenizer().save_pretrained(str(tmp_path))
    template = load_chat_template(str(tmp_path), None)
    with pytest.raises(ChatTemplateError, match="tool messages are not supported"):
        template.render([{"role": "tool", "content": "x"}])
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for %}")
    with pytest.raises(ValueError, match="bad.jinja: not a valid jinja2 chat template"):
        load_chat_template(None, str(bad))


def test_sandbox_refuses_attribute_escapes(tmp_path):
    file = tmp_path / "evil.jinja"
    file.write_text("{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError, match="unsafe|access"):
        load_chat_template(None, str(file)).render([])


def test_chat_request_fields():
    r = parse_chat_request(
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                }
            ],
            "max_completion_tokens": 5,
            "max_tokens": 9,
            "logprobs": True,
            "top_logprobs": 2,
            "n": 3,
            "seed": 1,
        },
        model_name="m",
    )
    assert r.messages[0]["content"] == "a\nb" and r.logprobs == 2 and r.add_generation_prompt
    assert r.options.max_tokens == 5 and r.options.n == 3
    r = parse_chat_request({"messages": [{"role": "user", "content": "x"}]}, model_name="m")
    assert r.options.max_tokens is None and r.logprobs is None


@pytest.mark.parametrize(
    ("body", "pattern"),
    [
        ({}, "'messages' must be a non-empty list"),
        ({"messages": [{"content": "x"}]}, r"messages\[0\] must be an object with a 'role'"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "role must be one of"),
        ({"messages": [{"role": "user", "content": 3}]}, "content must be a string"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "only text parts"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "needs 'logprobs'"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{}]}, "'tools' is not"),
        ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, ">= 1"),
    ],
)
def test_malformed_chat_requests_name_the_field(body, pattern):
    with pytest.raises(ProtocolError, match=pattern):
        parse_chat_request(body, model_name="m")


def test_a_malformed_message_is_a_400_naming_the_messages_field():
    # launch.text.chat_messages raises ValueError; the server answers it as a protocol error
    with pytest.raises(ProtocolError, match=r"messages\[1\]\.role") as e:
        parse_chat_request({"messages": [{"role": "user"}, {"role": "robot"}]}, model_name="m")
    assert e.value.param == "messages" and e.value.status == 400


@pytest.mark.parametrize(
    ("content", "pattern"),
    [
        (None, "--chat-template .*missing.jinja: no such file"),
        ("{% for %}", ".*jinja: not a valid jinja2"),
    ],
)
def test_serve_refuses_a_bad_chat_template_before_starting(tmp_path, capsys, content, pattern):
    from launch import serve

    path = tmp_path / "missing.jinja"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as info:
        serve.main([f"--chat-template={path}"])
    assert info.value.code != 0
    err = capsys.readouterr().err
    assert re.search(r"launch\.serve \[rank 0\]: error: " + pattern, err), err


def test_chat_template_kwargs_add_variables_but_never_replace_messages(tmp_path):
    file = tmp_path / "t.jinja"
    file.write_text("{{ messages | length }}{% if enable_thinking %}T{% endif %}{{ bos_token }}")
    template = load_chat_template(None, str(file))
    messages = [{"role": "user", "content": "x"}]
    assert template.render(messages, variables={"enable_thinking": True, "bos_token": "B"}) == "1TB"
    assert template.render(messages, variables={"messages": [], "tools": 1}) == "1"

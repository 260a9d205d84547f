"""ternlm.text.chat.render_chat renders exactly what transformers' apply_chat_template(tokenize=False)
renders, inside a sandbox, and turns template failures into ChatTemplateError."""
from __future__ import annotations

import importlib

from pathlib import Path

import pytest

from ternlm.text.chat import ChatTemplateError, message_boundaries, render_chat
from ternlm.models.registry import model_path


def model_file(name: str) -> Path:
    """A registry model, fetched and verified on first use."""
    return model_path(name, progress=False)


@pytest.fixture(scope="module")
def hf():
    transformers = importlib.import_module("transformers")
    path = model_file("smollm2-135m")
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def ours(template: str, messages: list[dict], hf_tok, **kw) -> str:
    return render_chat(template, messages, bos_token=hf_tok.bos_token, eos_token=hf_tok.eos_token, **kw)


CONVERSATIONS = {
    "single": [{"role": "user", "content": "Hi!"}],
    "multi_turn": [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3+3? 🙂 你好"},
    ],
    "with_system": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another <one> & \"quoted\"\n  indented"},
    ],
    "ends_with_assistant": [
        {"role": "user", "content": "Say x"},
        {"role": "assistant", "content": "x"},
    ],
}


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", CONVERSATIONS)
def test_smollm2_template_matches_transformers(hf, name, add_generation_prompt):
    messages = CONVERSATIONS[name]
    expected = hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    got = ours(hf.chat_template, messages, hf, add_generation_prompt=add_generation_prompt)
    assert got == expected


def test_default_system_prompt_only_without_system_message(hf):
    without = ours(hf.chat_template, CONVERSATIONS["single"], hf, add_generation_prompt=True)
    with_sys = ours(hf.chat_template, CONVERSATIONS["with_system"], hf, add_generation_prompt=True)
    assert "named SmolLM" in without and "named SmolLM" not in with_sys
    assert without.endswith("<|im_start|>assistant\n")


# A Qwen2.5-style template: tools in the system prompt through `tojson`, assistant tool calls,
# consecutive tool results folded into one user turn, `raise_exception` for unknown roles.
QWEN_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n" }}
    {{- "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, "
        "\\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if message.role not in ['system', 'user', 'assistant', 'tool'] %}
        {{- raise_exception('Unknown role: ' + message.role) }}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city <now> & later",
        "parameters": {"type": "object",
                       "properties": {"city": {"type": "string", "description": "e.g. 東京"}},
                       "required": ["city"]},
    },
}]

TOOL_CHAT = [
    {"role": "system", "content": "You help with weather."},
    {"role": "user", "content": "Weather in Tokyo and Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "東京"}}},
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
    ]},
    {"role": "tool", "content": "{\"temp\": 21}"},
    {"role": "tool", "content": "{\"temp\": 18}"},
    {"role": "assistant", "content": "Tokyo 21°C, Paris 18°C."},
    {"role": "user", "content": "Thanks"},
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("tools", [TOOLS, None], ids=["tools", "no_tools"])
def test_qwen_style_template_with_tools_matches_transformers(hf, tools, add_generation_prompt):
    expected = hf.apply_chat_template(TOOL_CHAT, chat_template=QWEN_TEMPLATE, tools=tools,
                                      add_generation_prompt=add_generation_prompt, tokenize=False)
    got = ours(QWEN_TEMPLATE, TOOL_CHAT, hf, tools=tools, add_generation_prompt=add_generation_prompt)
    assert got == expected
    if tools:
        assert '"description": "e.g. 東京"' in got           # tojson: ensure_ascii=False
        assert "<now> & later" in got                          # tojson: no HTML escaping
        assert '{"name": "get_weather", "arguments": {"city": "東京"}}' in got
    assert "None" not in got  # content=None is dropped, as HF does, not rendered


def test_tojson_options_match_transformers(hf):
    template = ("{{ tools | tojson(indent=2) }}|{{ tools[0] | tojson(separators=(',', ':'), sort_keys=true) }}"
                "|{{ '<&>' | tojson }}")
    expected = hf.apply_chat_template(CONVERSATIONS["single"], chat_template=template, tools=TOOLS, tokenize=False)
    assert ours(template, CONVERSATIONS["single"], hf, tools=TOOLS, add_generation_prompt=False) == expected


def test_extras_and_undefined_specials(hf):
    template = ("{{ bos_token }}[{{ eos_token }}]{% if enable_thinking is defined %}T={{ enable_thinking }}{% endif %}"
                "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}{% endfor %}"
                "{% generation %}G{% endgeneration %}{{ documents is none }}{{ tools is none }}")
    out = render_chat(template, CONVERSATIONS["multi_turn"], add_generation_prompt=False, bos_token="<s>",
                      eos_token=None, enable_thinking=False)
    assert out == "<s>[]T=FalseWhat is 2+2?GTrueTrue"
    expected = hf.apply_chat_template(CONVERSATIONS["multi_turn"], chat_template=template, tokenize=False,
                                      enable_thinking=False)
    assert out.split("]", 1)[1] == expected.split("]", 1)[1]


def test_raise_exception_becomes_chat_template_error():
    with pytest.raises(ChatTemplateError, match="Unknown role: robot"):
        render_chat(QWEN_TEMPLATE, [{"role": "robot", "content": "beep"}], add_generation_prompt=True,
                    bos_token=None, eos_token=None)
    assert issubclass(ChatTemplateError, ValueError)


@pytest.mark.parametrize("template,match", [
    ("{% if %}", "syntax error at line 1"),
    ("{% for m in messages %}", "syntax error"),
    ("ok\n{{ messages[0].content.nope.deeper }}", "line 2.*UndefinedError"),
    ("{{ 1 / 0 }}", "ZeroDivisionError"),
])
def test_template_failures_are_chat_template_errors(template, match):
    with pytest.raises(ChatTemplateError, match=match):
        render_chat(template, CONVERSATIONS["single"], add_generation_prompt=False, bos_token=None, eos_token=None)


def test_sandbox_blocks_class_walk():
    with pytest.raises(ChatTemplateError, match="SecurityError.*__class__"):
        render_chat("{{ ''.__class__.__mro__ }}", [], add_generation_prompt=False, bos_token=None, eos_token=None)


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__ }}",
    "{{ messages.__class__ }}",
    "{{ cycler.__init__.__globals__ }}",
    "{% set ns = namespace() %}{% set ns._x = 1 %}",
    "{{ messages.append({'role': 'x'}) }}",       # immutable sandbox: no mutating methods
    "{{ messages[0].update({'content': 'x'}) }}",
    "{{ dict.__call__ }}",
])
def test_sandbox_blocks_escapes(template):
    messages = [{"role": "user", "content": "hi"}]
    # jinja's sandbox turns an unsafe attribute into an undefined value: printing it gives "",
    # using it further raises SecurityError. Either way nothing of the object leaks out.
    try:
        out = render_chat(template, messages, add_generation_prompt=False, bos_token=None, eos_token=None)
    except ChatTemplateError as e:
        assert "SecurityError" in str(e)
    else:
        assert out == ""
    assert messages == [{"role": "user", "content": "hi"}]


def test_inputs_are_plain_copies():
    class Rich(str):
        def danger(self):
            raise AssertionError("the template reached a caller object's method")

    messages = [{"role": "user", "content": Rich("hi")}]
    with pytest.raises(ChatTemplateError):
        render_chat("{{ messages[0].content.danger() }}", messages, add_generation_prompt=False,
                    bos_token=None, eos_token=None)
    out = render_chat("{{ messages[0].content }}{{ dict(a=1) }}{% set ns = namespace(n=2) %}{{ ns.n }}",
                      messages, add_generation_prompt=False, bos_token=None, eos_token=None)
    assert out == "hi{'a': 1}2"


def test_message_boundaries(hf):
    messages = CONVERSATIONS["with_system"]
    kw = dict(add_generation_prompt=True, bos_token=hf.bos_token, eos_token=hf.eos_token)
    full = render_chat(hf.chat_template, messages, **kw)
    ends = message_boundaries(hf.chat_template, messages, **kw)
    assert len(ends) == len(messages) and ends == sorted(ends)
    for end, message in zip(ends, messages):
        assert full[:end].endswith(message["content"] + "<|im_end|>\n")
    assert full[ends[-1]:] == "<|im_start|>assistant\n"


def test_message_boundaries_none_where_not_a_prefix():
    # Renders the last message differently from earlier ones, so shorter renders are no prefix.
    template = ("{% for m in messages %}{% if loop.last %}[{{ m.content }}]{% else %}{{ m.content }}{% endif %}"
                "{% endfor %}")
    messages = [{"role": "user", "content": c} for c in ("a", "b", "c")]
    ends = message_boundaries(template, messages, add_generation_prompt=False, bos_token=None, eos_token=None)
    assert ends == [None, None, 5]
    raising = "{% if messages[-1].role != 'user' %}{{ raise_exception('last must be user') }}{% endif %}x"
    chat = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    assert message_boundaries(raising, chat, add_generation_prompt=True, bos_token=None, eos_token=None) == [1, None, 1]

"""Tool-call parsers per model family (``hermes``, ``mistral``, ``pythonic``, ``llama3_json``), the ``qwen3``
reasoning parser, ``--tool-call-parser auto``, and each family's chat template (tests/data/chat_templates/,
written by us to each family's documented prompt format).

Expected values come from the formats' documentation (the text a model of that family writes), never from
the code under test: each parser must read the model-style string into the calls written in it, streamed
token by token through the real SmolLM2 tokenizer as well as whole, and each template must write a call
history in the very format its family's parser reads. One server test at the end: the real SmolLM2
server with the Qwen3 template, ``--tool-call-parser hermes --reasoning-parser qwen3``, through the
``openai`` SDK.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import jsonschema
import openai
import pytest

from server_utils import running_server

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
MODEL = "SmolLM2-135M-Instruct"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 10}},
                   "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}

# What each family's model writes for "weather in Paris (celsius), and the time in CET" (its documented
# format), and the calls that text holds.
CALLS = [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"zone": "CET"})]
MODEL_TEXT = {
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
              '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
    "mistral": '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
               '{"name": "get_time", "arguments": {"zone": "CET"}}]',
    "pythonic": '[get_weather(city="Paris", unit="celsius"), get_time(zone="CET")]',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
                   '{"name": "get_time", "parameters": {"zone": "CET"}}',
}
# The call syntax each format has: none of it may reach the content.
MARKUP = {"hermes": ["<tool_call", "</tool_call", '"arguments"'], "mistral": ["[TOOL_CALLS", '"arguments"'],
          "pythonic": ["get_weather(", "get_time(", 'city="'], "llama3_json": ['"parameters"', '{"name']}


@pytest.fixture(scope="module")
def tok():
    from tinyvllm.engine.tokenizer import load_tokenizer
    from tinyvllm.model.loader import resolve_model

    return load_tokenizer(resolve_model(MODEL).model_dir)


def _token_deltas(tok, text: str) -> list[str]:
    """``text`` as the server streams it: one delta per token of the real tokenizer."""
    ids = tok(text, add_special_tokens=False)["input_ids"]
    out, prev = [], ""
    for k in range(1, len(ids) + 1):
        cur = tok.decode(ids[:k])
        out.append(cur[len(prev):])
        prev = cur
    assert prev == text
    return out


def _stream(parser, deltas: list[str]) -> tuple[str, list[tuple[str, dict]], list[list[dict]]]:
    from tinyvllm.entrypoints.openai.tool_parsers import StreamingToolCallParser

    s = StreamingToolCallParser(parser)
    content, chunks = "", []
    for k, d in enumerate(deltas):
        c, ch = s.feed(d, final=k == len(deltas) - 1)
        content += c
        chunks += ch
    calls, args = [], {}
    for ch in chunks:  # OpenAI's shape: a header delta (id, type, name, ""), then the arguments
        (item,) = ch
        if "id" in item:
            assert item["type"] == "function" and item["function"]["arguments"] == ""
            calls.append(item["function"]["name"])
        else:
            args[item["index"]] = json.loads(item["function"]["arguments"])
    return content, [(n, args[i]) for i, n in enumerate(calls)], chunks


# ----------------------------------------------------------------------------- parsers


@pytest.mark.parametrize("fmt", list(MODEL_TEXT))
def test_model_style_calls_round_trip(tok, fmt):
    from tinyvllm.entrypoints.openai.tool_parsers import get_tool_parser

    p = get_tool_parser(fmt)
    for text, want_content in ((MODEL_TEXT[fmt], None), ("Let me check. " + MODEL_TEXT[fmt], "Let me check.")):
        if fmt == "llama3_json" and want_content:  # Llama writes its JSON calls alone
            continue
        content, calls = p.extract(text)
        assert content == want_content
        assert [(c.name, json.loads(c.arguments)) for c in calls] == CALLS
        assert len({c.id for c in calls}) == 2
        if fmt == "mistral":  # Mistral's templates take only 9 letters and digits as a call id
            assert all(re.fullmatch(r"[A-Za-z0-9]{9}", c.id) for c in calls)
        s_content, s_calls, _ = _stream(get_tool_parser(fmt), _token_deltas(tok, text))
        assert s_calls == CALLS and s_content.strip() == (want_content or "")


def test_mistral_v11_and_llama_python_tag_shapes(tok):
    from tinyvllm.entrypoints.openai.tool_parsers import get_tool_parser

    v11 = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}[TOOL_CALLS]get_time{"zone": "CET"}'
    tagged = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}'
    for fmt, text, want in (("mistral", v11, CALLS), ("llama3_json", tagged, CALLS[:1])):
        content, calls = get_tool_parser(fmt).extract(text)
        assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == want
        assert _stream(get_tool_parser(fmt), _token_deltas(tok, text))[1] == want


@pytest.mark.parametrize("fmt,text", [
    ("hermes", "The weather is <b>fine</b> [1] {\"a\": 1}"),
    ("mistral", "Use [brackets] and {braces}: [TOOL] is not a call."),
    ("pythonic", "A list [1, 2] and a call-like f(x) outside a list [note]"),
    ("llama3_json", '{"answer": 42} is the JSON you asked for'),
])
def test_text_that_is_not_a_call_is_content(tok, fmt, text):
    from tinyvllm.entrypoints.openai.tool_parsers import get_tool_parser

    assert get_tool_parser(fmt).extract(text) == (text, [])
    content, calls, _ = _stream(get_tool_parser(fmt), _token_deltas(tok, text))
    assert (content, calls) == (text, [])


@pytest.mark.parametrize("fmt", list(MODEL_TEXT))
def test_cut_markup_never_reaches_content(tok, fmt):
    # Issue 41's rule for every format: wherever max_tokens cuts the output, complete calls are kept, the
    # cut call and a partial start marker are dropped, and streamed and whole parsing agree.
    from tinyvllm.entrypoints.openai.tool_parsers import get_tool_parser

    full = "Sure. " + MODEL_TEXT[fmt] if fmt != "llama3_json" else MODEL_TEXT[fmt]
    ids = tok(full, add_special_tokens=False)["input_ids"]
    for k in range(len(ids) + 1):
        text = tok.decode(ids[:k])
        content, calls = get_tool_parser(fmt).extract(text)
        got = [(c.name, json.loads(c.arguments)) for c in calls]
        assert got == CALLS[:len(got)], (k, text)
        assert "Sure.".startswith((content or "").strip()), (k, text, content)
        s_content, s_calls, _ = _stream(get_tool_parser(fmt), _token_deltas(tok, text) if text else [""])
        assert s_calls == got and s_content.strip() == (content or "").strip(), (k, text, s_content)
        for m in MARKUP[fmt]:
            assert m not in (content or "") and m not in s_content, (k, text)
    assert len(get_tool_parser(fmt).extract(full)[1]) == 2


# Pieces of each format's syntax, text and broken markers, joined at random into outputs.
FRAGMENTS = {
    "hermes": ["<tool_call>", "</tool_call>", '\n{"name": "f", "arguments": {"a": 1}}\n', "<tool", "hi ", "\n", "{",
               "}", '"x"', "<"],
    "mistral": ["[TOOL_CALLS]", "[", "]", '{"name": "f", "arguments": {"a": 1}}', ", ", "f", "[ARGS]", '{"a": 2}',
                "hi ", "[TOOL"],
    "pythonic": ["[", "]", "f(", ")", "a=1", ", ", '"s)"', "hi ", "g", "(", "x"],
    "llama3_json": ["<|python_tag|>", '{"name": "f", "parameters": {"a": 1}}', "; ", "{", "}", '"name"', ":", "hi ",
                    "<|py", " "],
}


@pytest.mark.parametrize("fmt", list(FRAGMENTS))
def test_streamed_equals_whole_on_random_outputs(fmt):
    # Whatever the text and however it is split into deltas, the stream sends the same calls as the whole
    # output holds, and the same content (up to the whitespace at its ends when there are calls).
    import random

    from tinyvllm.entrypoints.openai.tool_parsers import StreamingToolCallParser, get_tool_parser

    rng = random.Random(43)
    for _ in range(1500):
        text = "".join(rng.choice(FRAGMENTS[fmt]) for _ in range(rng.randint(0, 8)))
        content, calls = get_tool_parser(fmt).extract(text)
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 5)))) if len(text) > 1 else []
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])] or [""]
        s, out, n = StreamingToolCallParser(get_tool_parser(fmt)), "", 0
        for k, piece in enumerate(pieces):
            c, ch = s.feed(piece, final=k == len(pieces) - 1)
            out, n = out + c, n + len(ch)
        assert n == 2 * len(calls), (text, pieces)
        assert (out.strip() if calls else out) == (content or ""), (text, pieces, out, content)


@pytest.mark.parametrize("fmt", list(MODEL_TEXT))
def test_grammar_accepts_the_format_and_enforces_the_schema(fmt):
    # The constrained path (tool_choice required / named / auto) writes the parser's own format: the
    # grammar accepts the model-style text (as the grammar writes it: no space after the marker), and
    # refuses arguments outside the schema and an unknown function.
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from tinyvllm.entrypoints.openai.tool_calls import tool_grammar
    from tinyvllm.entrypoints.openai.tool_parsers import get_tool_parser

    p = get_tool_parser(fmt)
    good = {"hermes": MODEL_TEXT["hermes"], "mistral": MODEL_TEXT["mistral"].replace("] [", "]["),
            "pythonic": MODEL_TEXT["pythonic"], "llama3_json": MODEL_TEXT["llama3_json"]}[fmt]
    bad_unit = good.replace("celsius", "kelvin")
    bad_name = good.replace("get_time", "get_tide")

    def g(choice, parallel=True):
        return xgr.Grammar.from_structural_tag(tool_grammar(p, TOOLS, choice, parallel))

    assert accepts(g("required"), good)
    assert not accepts(g("required"), bad_unit) and not accepts(g("required"), bad_name)
    assert not accepts(g("required", parallel=False), good)  # one call only
    first = p.extract(good)[1][0]
    one = good[:len(good)]  # the first call alone, in the format's one-call shape
    one = {"hermes": good.split("\n<tool_call>")[0], "mistral": good.split(", {")[0] + "]",
           "pythonic": good.split(", get_time")[0] + "]", "llama3_json": good.split("; ")[0]}[fmt]
    assert accepts(g({"name": "get_weather"}), one) and not accepts(g({"name": "get_time"}), one)
    assert (first.name, json.loads(first.arguments)) == CALLS[0]
    assert accepts(g("auto"), "Let me look that up. " + good) and accepts(g("auto"), "No tools needed.")
    assert not accepts(g("auto"), "Let me look that up. " + bad_unit)
    # With a reasoning parser: an optional thought first; a thought the prompt opened must be closed first.
    from tinyvllm.entrypoints.openai.reasoning import get_reasoning_parser

    r = get_reasoning_parser("qwen3")
    free = xgr.Grammar.from_structural_tag(tool_grammar(p, TOOLS, "required", True, r.grammar_prefix(False)))
    opened = xgr.Grammar.from_structural_tag(tool_grammar(p, TOOLS, "required", True, r.grammar_prefix(True)))
    assert accepts(free, "<think>\nThe weather tool.\n</think>\n\n" + good) and accepts(free, good)
    assert accepts(opened, "The weather tool.\n</think>\n\n" + good) and not accepts(opened, good)


# ----------------------------------------------------------------------------- reasoning


REASONING_CASES = [
    # (output, prompt opened the thought, reasoning, content)
    ("<think>\nThe user wants 2+2.\n</think>\n\nIt is 4.", False, "\nThe user wants 2+2.\n", "It is 4."),
    ("It is 4.", False, None, "It is 4."),
    ("The user wants 2+2.\n</think>\n\nIt is 4.", True, "The user wants 2+2.\n", "It is 4."),
    ("<think>\nStill thinking about", False, "\nStill thinking about", ""),  # cut by max_tokens
    ("<think>\nalmost</thi", False, "\nalmost", ""),  # a partial end marker is dropped
    ("Answer with </think> in it", False, None, "Answer with </think> in it"),
]


@pytest.mark.parametrize("output,opened,reasoning,content", REASONING_CASES)
def test_qwen3_reasoning_split(tok, output, opened, reasoning, content):
    from tinyvllm.entrypoints.openai.reasoning import get_reasoning_parser

    p = get_reasoning_parser("qwen3")
    assert p.extract(output, opened) == (reasoning, content)
    s = p.stream(opened)
    deltas = _token_deltas(tok, output)
    r = c = ""
    for k, d in enumerate(deltas):
        dr, dc = s.feed(d, final=k == len(deltas) - 1)
        r, c = r + dr, c + dc
    assert (r or None, c) == (reasoning, content)


def test_reasoning_then_tool_calls_in_one_output(tok):
    from tinyvllm.entrypoints.openai.chat_output import ChatOutputParser
    from tinyvllm.entrypoints.openai.reasoning import get_reasoning_parser
    from tinyvllm.entrypoints.openai.tool_parsers import get_tool_parser

    text = "<think>\nI need the weather tool.\n</think>\n\n" + MODEL_TEXT["hermes"]
    p = ChatOutputParser(get_reasoning_parser("qwen3"), False, get_tool_parser("hermes"))
    reasoning, content, calls = p.parse(text)
    assert reasoning == "\nI need the weather tool.\n" and content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == CALLS
    s = ChatOutputParser(get_reasoning_parser("qwen3"), False, get_tool_parser("hermes"))
    r, c, n = "", "", 0
    deltas = _token_deltas(tok, text)
    for k, d in enumerate(deltas):
        dr, dc, ch = s.feed(d, final=k == len(deltas) - 1)
        r, c, n = r + dr, c + dc, n + len(ch)
    assert r == reasoning and c == "" and n == 4 and s.num_calls == 2


# ----------------------------------------------------------------------------- templates


def _chat(tok, template: str | None, parser: str = "hermes", reasoning: str | None = None):
    """The server's chat endpoint object over the real tokenizer (rendering needs no engine)."""
    from tinyvllm.entrypoints.openai.serving_chat import OpenAIServingChat

    engine = SimpleNamespace(tokenizer=tok, model_name=MODEL, max_model_len=8192)
    return OpenAIServingChat(engine, None, template, parser, reasoning)


def _render(serving, messages, tools=None, **fields) -> str:
    from tinyvllm.entrypoints.openai.protocol import ChatCompletionRequest

    req = ChatCompletionRequest.model_validate({"messages": messages, **fields})
    ids = serving._chat_prompt_ids(req, req.messages, True, False, tools)
    return serving.tokenizer.decode(ids)


def _history(call_ids: tuple[str, str]) -> list[dict]:
    return [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Paris, and the time in CET?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call_ids[0], "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps(CALLS[0][1])}},
            {"id": call_ids[1], "type": "function",
             "function": {"name": "get_time", "arguments": json.dumps(CALLS[1][1])}}]},
        {"role": "tool", "tool_call_id": call_ids[0], "content": "18 C, sunny"},
        {"role": "tool", "tool_call_id": call_ids[1], "content": "14:05"},
    ]


# family: (template, parser, the assistant turn's span in the prompt, documented markers in order, prompt end)
FAMILIES = {
    "qwen2_5": ("hermes", r"<\|im_start\|>assistant\n(.*?)<\|im_end\|>",
                ["<|im_start|>system\nYou are terse.", "<tools>", '"name": "get_weather"', "</tools>",
                 "<|im_start|>user\nWeather in Paris", "<|im_start|>assistant\n<tool_call>",
                 "<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response>\n<tool_response>\n14:05"],
                "<|im_start|>assistant\n"),
    "qwen3": ("hermes", r"<\|im_start\|>assistant\n(.*?)<\|im_end\|>",
              ["<|im_start|>system\nYou are terse.", "<tools>", "</tools>", "<|im_start|>user\nWeather",
               "<|im_start|>assistant\n<tool_call>", "<tool_response>\n18 C, sunny\n</tool_response>"],
              "<|im_start|>assistant\n"),
    "mistral": ("mistral", r"\[/INST\](\[TOOL_CALLS\].*?\])", [
                "[AVAILABLE_TOOLS] [", '"name": "get_weather"', "[/AVAILABLE_TOOLS]",
                "[INST] You are terse.\n\nWeather in Paris", "[/INST][TOOL_CALLS] [",
                '[TOOL_RESULTS] {"content": "18 C, sunny", "call_id": "', "[/TOOL_RESULTS]"], "[/TOOL_RESULTS]"),
    "gemma3": ("pythonic", r"<start_of_turn>model\n(.*?)<end_of_turn>",
               ["<start_of_turn>user\nYou are terse.", '"name": "get_weather"', "Weather in Paris",
                "<end_of_turn>\n<start_of_turn>model\n[get_weather(",
                "<start_of_turn>user\n```tool_output\n18 C, sunny\n```"], "<start_of_turn>model\n"),
    "llama3": ("llama3_json", r"<\|start_header_id\|>assistant<\|end_header_id\|>\n\n(.*?)<\|eot_id\|>",
               ["<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython", "You are terse.<|eot_id|>",
                "<|start_header_id|>user<|end_header_id|>\n\n", '"name": "get_weather"', "Weather in Paris",
                '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", "parameters": ',
                "<|start_header_id|>ipython<|end_header_id|>\n\n18 C, sunny<|eot_id|>"],
               "<|start_header_id|>assistant<|end_header_id|>\n\n"),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_template_renders_tools_and_history_in_the_family_format(tok, family):
    # Rendered through the server's own chat rendering (--chat-template), with tools and a tool-result
    # history: the documented markers in order, and the history's calls written in the format that the
    # family's parser (chosen by --tool-call-parser auto from the same template) reads back.
    from tinyvllm.entrypoints.openai.tool_parsers import get_tool_parser

    template = (TEMPLATES / f"{family}.jinja").read_text()
    parser, span, markers, end = FAMILIES[family]
    serving = _chat(tok, template, "auto")
    assert serving.tool_call_parser == parser
    ids = ("a1B2c3D4e", "Z9y8X7w6v") if parser == "mistral" else ("call_1", "call_2")
    text = _render(serving, _history(ids), TOOLS)
    pos = 0
    for m in markers:
        i = text.find(m, pos)
        assert i >= 0, (m, text)
        pos = i + len(m)
    assert text.endswith(end), text[-80:]
    turn = re.search(span, text, re.DOTALL).group(1)
    content, calls = get_tool_parser(parser).extract(turn)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == CALLS and not content


def test_auto_keeps_hermes_for_a_template_without_a_tool_format(tok):
    # SmolLM2's own template shows no tool format: auto falls back to hermes, and a request with tools
    # is rendered with tinyvllm's Hermes template (the default path, unchanged).
    serving = _chat(tok, None, "auto")
    assert serving.tool_call_parser == "hermes"
    text = _render(serving, [{"role": "user", "content": "Weather in Paris?"}], TOOLS)
    assert "<tools>" in text and "<tool_call>" in text and text.endswith("<|im_start|>assistant\n")
    plain = _render(serving, [{"role": "user", "content": "Hi"}])  # no tools: the model's own template
    assert plain == tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                            add_generation_prompt=True)


def test_mistral_template_refuses_openai_style_ids(tok):
    # Mistral's format takes 9-character ids only: the parser makes such ids (tested above); an id of
    # another shape in the history is a 400 naming messages, not a broken prompt.
    from tinyvllm.engine.input_processor import InvalidRequestError

    serving = _chat(tok, (TEMPLATES / "mistral.jinja").read_text(), "mistral")
    with pytest.raises(InvalidRequestError) as e:
        _render(serving, _history(("call_1", "call_2")), TOOLS)
    assert e.value.param == "messages" and "9" in str(e.value)


def test_enable_thinking_reaches_the_template(tok):
    from tinyvllm.engine.input_processor import InvalidRequestError

    serving = _chat(tok, (TEMPLATES / "qwen3.jinja").read_text(), "hermes", "qwen3")
    ask = [{"role": "user", "content": "2+2?"}]
    off = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert _render(serving, ask).endswith("<|im_start|>assistant\n")
    assert _render(serving, ask, chat_template_kwargs={"enable_thinking": False}).endswith(off)
    assert _render(serving, ask, enable_thinking=False).endswith(off)
    for fields, param in (({"chat_template_kwargs": {"enable_thinking": "no"}}, "chat_template_kwargs.enable_thinking"),
                          ({"enable_thinking": True, "chat_template_kwargs": {"enable_thinking": False}},
                           "enable_thinking")):
        with pytest.raises(InvalidRequestError) as e:
            _render(serving, ask, **fields)
        assert e.value.param == param
    # The prompt decides where the output starts: an empty closed thought is not an open one.
    ids_off = tok(_render(serving, ask, enable_thinking=False), add_special_tokens=False)["input_ids"]
    ids_open = tok("<|im_start|>assistant\n<think>\n", add_special_tokens=False)["input_ids"]
    assert not serving.prompt_opens_thought(ids_off) and serving.prompt_opens_thought(ids_open)


def test_special_token_markers_are_kept_in_the_text(tok):
    # [TOOL_CALLS] is a special token in Mistral's tokenizers: with skip_special_tokens the detokenized
    # text would lose it, so requests with tools turn it off (as vLLM's mistral parser does).
    import copy

    from tinyvllm.sampling_params import SamplingParams

    mtok = copy.deepcopy(tok)
    mtok.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    tid = mtok.convert_tokens_to_ids("[TOOL_CALLS]")
    assert mtok.decode([tid], skip_special_tokens=True) == ""  # why the flag matters
    serving = _chat(mtok, (TEMPLATES / "mistral.jinja").read_text(), "mistral")
    params = SamplingParams()
    serving.keep_marker_tokens(params, use_tools=False)
    assert params.skip_special_tokens
    serving.keep_marker_tokens(params, use_tools=True)
    assert not params.skip_special_tokens
    params = SamplingParams()
    _chat(tok, None, "mistral").keep_marker_tokens(params, use_tools=True)  # plain text in SmolLM2's
    assert params.skip_special_tokens


# ----------------------------------------------------------------------------- the real server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    args = ["--max-model-len", "1024", "--max-num-seqs", "4", "--kv-cache-memory", "64MiB",
            "--chat-template", str(TEMPLATES / "qwen3.jinja"), "--tool-call-parser", "hermes",
            "--reasoning-parser", "qwen3"]
    yield from running_server(tmp_path_factory.mktemp("server") / "server.log", args)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0, timeout=300)


def test_server_qwen3_template_tool_choice_required(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the weather like in Paris today?"}],
        tools=TOOLS, tool_choice="required", parallel_tool_calls=False, temperature=0,
        max_completion_tokens=60, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1
    call = ch.message.tool_calls[0]
    assert call.type == "function" and call.function.name in SCHEMAS
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert not ch.message.content and ch.message.model_extra.get("reasoning_content") is None


def test_server_reasoning_content_whole_and_streamed(client):
    # The thought is forced by a regex (SmolLM2 does not think by itself): it comes back apart from the
    # answer, in the message and in the stream's deltas alike.
    body = dict(model=MODEL, messages=[{"role": "user", "content": "Is Paris in France?"}], temperature=0,
                max_completion_tokens=40, extra_body={"structured_outputs": {
                    "regex": r"<think>\n[A-Za-z ]{4,40}\.\n</think>\n\n(Yes|No)[a-z ,.]{0,20}"}})
    m = client.chat.completions.create(**body).choices[0].message
    reasoning = m.model_extra["reasoning_content"]
    assert re.fullmatch(r"\n[A-Za-z ]{4,40}\.\n", reasoning) and re.fullmatch(r"(Yes|No)[a-z ,.]*", m.content)
    r_parts, c_parts = [], []
    for chunk in client.chat.completions.create(stream=True, **body):
        for c in chunk.choices:
            r_parts.append((c.delta.model_extra or {}).get("reasoning_content") or "")
            c_parts.append(c.delta.content or "")
    assert "".join(r_parts) == reasoning and "".join(c_parts) == m.content

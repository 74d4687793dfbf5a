"""Parsing, schema checks and comparison of tool calls (logitdiff.flips.toolcalls)."""

import json

import pytest

from _tasks import TOOLS, tool_call_text
from logitdiff.errors import LogitdiffError
from logitdiff.flips.toolcalls import ToolCall, check_tools_schema, compare_calls, normalize_string, parse_tool_calls, validate_call, values_equal

W = ToolCall("get_weather", {"city": "Paris", "unit": "celsius"})
T = ToolCall("set_timer", {"minutes": 5, "label": "tea"})


def _fn(name, props, required, **extra):
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": props, "required": required, **extra}}}


# ---------------------------------------------------------------------------------- hermes


def test_hermes_single_as_the_bundled_model_writes_it():
    p = parse_tool_calls(tool_call_text(W.name, W.arguments))
    assert (p.format, p.calls, p.error) == ("hermes", [W], None)
    assert p.attempted and p.ok


def test_hermes_parallel_with_prose_and_parameters_alias():
    text = ("<think>two calls</think>Sure.\n<tool_call>\n" + json.dumps(W.to_json()) + "\n</tool_call>\n"
            '<tool_call>{"name": "set_timer", "parameters": {"minutes": 5, "label": "tea"}}</tool_call><|im_end|>')
    p = parse_tool_calls(text)
    assert p.ok and p.format == "hermes" and p.calls == [W, T]


@pytest.mark.parametrize("text, fragment", [
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Par', "no closing"),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Par</tool_call>', "invalid or truncated JSON"),
    ('<tool_call>{"arguments": {}}</tool_call>', "missing function name"),
    ('<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": 1}"}</tool_call>', "'arguments' is string"),
    ('<tool_call>{"name": "get_weather"}</tool_call>', "missing 'arguments'"),
    ('<tool_call>[1]</tool_call>', "expected a call object"),
    ('<tool_call>{"name": "a", "arguments": {}} <tool_call>{"name": "b", "arguments": {}}</tool_call>', "block 0: no closing"),
    ('{"name": "a", "arguments": {}}</tool_call>', "without an opening"),
])
def test_hermes_malformed(text, fragment):
    p = parse_tool_calls(text)
    assert p.format == "hermes" and p.attempted and not p.ok
    assert fragment in p.error, p.error


def test_hermes_error_keeps_calls_parsed_before_it():
    p = parse_tool_calls(tool_call_text(W.name, W.arguments) + '<tool_call>{"name": "x", "argu')
    assert p.calls == [W] and "block 1" in p.error and not p.ok


# --------------------------------------------------------------------------------- mistral


def test_mistral_json_list():
    p = parse_tool_calls("[TOOL_CALLS] " + json.dumps([W.to_json(), T.to_json()]) + "</s>")
    assert (p.format, p.calls, p.error) == ("mistral", [W, T], None)


def test_mistral_name_args_form_with_and_without_call_id():
    text = ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}'
            '[TOOL_CALLS]set_timer[CALL_ID]a1B2c3D4e[ARGS]{"minutes": 5, "label": "tea"}')
    p = parse_tool_calls(text)
    assert p.ok and p.format == "mistral" and p.calls == [W, T]


@pytest.mark.parametrize("text, fragment", [
    ("[TOOL_CALLS]", "nothing after"),
    ("[TOOL_CALLS][]", "empty call list"),
    ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": ', "invalid or truncated JSON"),
    ('[TOOL_CALLS][{"name": "f", "arguments": {}}] and then some', "invalid or truncated JSON"),
    ("[TOOL_CALLS]get_weather", "NAME[ARGS]"),
    ("[TOOL_CALLS]get_weather[ARGS][1, 2]", "not an object"),
])
def test_mistral_malformed(text, fragment):
    p = parse_tool_calls(text)
    assert p.format == "mistral" and not p.ok and fragment in p.error, p.error


# ---------------------------------------------------------------------------------- llama3


@pytest.mark.parametrize("text", [
    '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}<|eom_id|>',
    '  \n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}<|eot_id|>',
])
def test_llama3_single(text):
    p = parse_tool_calls(text)
    assert (p.format, p.calls, p.error) == ("llama3", [W], None)


def test_llama3_list_and_semicolons():
    a, b = json.dumps({"name": W.name, "parameters": W.arguments}), json.dumps({"name": T.name, "parameters": T.arguments})
    assert parse_tool_calls(f"[{a}, {b}]").calls == [W, T]
    p = parse_tool_calls(f"<|python_tag|>{a}; {b};")
    assert p.ok and p.format == "llama3" and p.calls == [W, T]


@pytest.mark.parametrize("text, fragment", [
    ('{"name": "get_weather", "parameters": {"city": "Pa', "invalid or truncated JSON"),
    ('{"name": "get_weather", "parameters": {}} I called the tool.', "unexpected text"),
    ('{"name": "Ada", "age": 36}', "missing 'arguments'"),
    ('[{"name": 3, "parameters": {}}]', "'name' is not a non-empty string"),
])
def test_llama3_malformed(text, fragment):
    p = parse_tool_calls(text)
    assert p.format == "llama3" and not p.ok and fragment in p.error, p.error


@pytest.mark.parametrize("text", [
    "",
    "The answer is 42.",
    'Use a dict like {"name": "x", "arguments": {}} to call it.',  # braces, but prose first
    "In Python, {k: v for k, v in d.items()} builds a dict; set() and {} differ.",
    '{"answer": 42}',  # a JSON answer without a "name" key
    "[1, 2, 3]",
    "I would call get_weather with city Paris.",
])
def test_prose_and_plain_json_are_not_attempted_calls(text):
    p = parse_tool_calls(text)
    assert (p.format, p.calls, p.error, p.attempted, p.ok) == (None, [], None, False, False)


def test_formats_select_and_order():
    text = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}'
    assert not parse_tool_calls(text, formats=("hermes", "mistral")).attempted
    both = "[TOOL_CALLS]" + json.dumps([T.to_json()]) + tool_call_text(W.name, W.arguments)
    assert parse_tool_calls(both).format == "hermes"
    assert parse_tool_calls(both, formats=("mistral", "hermes")).format == "mistral"
    with pytest.raises(LogitdiffError, match="unknown tool-call format 'xml'"):
        parse_tool_calls("x", formats=("xml",))


# ---------------------------------------------------------------------------------- openai


def test_openai_message_with_string_and_dict_arguments():
    msg = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(W.arguments)}},
        {"id": "c2", "type": "function", "function": {"name": "set_timer", "arguments": T.arguments}},
    ]}
    p = parse_tool_calls(msg)
    assert (p.format, p.calls, p.error) == ("openai", [W, T], None)
    assert parse_tool_calls(msg["tool_calls"]).calls == [W, T]  # the bare list
    noargs = parse_tool_calls([{"type": "function", "function": {"name": "now", "arguments": ""}}])
    assert noargs.ok and noargs.calls == [ToolCall("now", {})]


@pytest.mark.parametrize("entry, fragment", [
    ({"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Par'}}, "not valid JSON"),
    ({"type": "function", "function": {"name": "get_weather", "arguments": "[1]"}}, "array, not an object"),
    ({"type": "function", "function": {"arguments": "{}"}}, "missing function name"),
    ({"type": "function"}, "missing 'function'"),
])
def test_openai_malformed(entry, fragment):
    p = parse_tool_calls({"role": "assistant", "tool_calls": [entry]})
    assert p.format == "openai" and p.attempted and not p.ok and fragment in p.error, p.error


def test_openai_message_without_tool_calls_reads_content():
    assert not parse_tool_calls({"role": "assistant", "content": "Hello."}).attempted
    assert not parse_tool_calls({"role": "assistant", "content": None, "tool_calls": []}).attempted
    p = parse_tool_calls({"role": "assistant", "content": tool_call_text(W.name, W.arguments)})
    assert p.format == "hermes" and p.calls == [W]


# ------------------------------------------------------------------------------ schema checks


def test_bundled_tools_are_valid_schemas():
    check_tools_schema(TOOLS, "builtin")


@pytest.mark.parametrize("params, fragment", [
    ({"type": "objekt"}, "is not valid JSON Schema"),
    ({"type": "object", "properties": {"unit": {"type": "strin"}}}, "properties/unit/type"),
    ({"type": "object", "required": "city"}, "is not valid JSON Schema"),
    ([], "expected an object, got array"),
])
def test_invalid_schema_names_the_tool(params, fragment):
    tools = [TOOLS[0], {"type": "function", "function": {"name": "bad_tool", "parameters": params}}]
    with pytest.raises(LogitdiffError) as e:
        check_tools_schema(tools, "w.jsonl:3")
    msg = str(e.value)
    assert msg.startswith("w.jsonl:3: tools[1] ('bad_tool') field 'parameters' is not valid JSON Schema: ")
    assert fragment in msg and "\n" not in msg


def test_tools_need_unique_string_names():
    with pytest.raises(LogitdiffError, match=r"tools\[0\] needs a string function.name"):
        check_tools_schema([{"type": "function", "function": {"parameters": {}}}], "w")
    with pytest.raises(LogitdiffError, match=r"tools\[1\] \('get_weather'\) repeats the name of tools\[0\]"):
        check_tools_schema([TOOLS[0], TOOLS[0]], "w")


# ---------------------------------------------------------------------------- validate_call


def test_validate_call_valid_and_unknown_function():
    assert validate_call(W, TOOLS) == []
    assert validate_call(ToolCall("get_time", {}), TOOLS) == ["unknown function 'get_time'"]


def test_validate_call_flags_wrong_types_missing_and_unknown_arguments():
    errs = validate_call(ToolCall("set_timer", {"minutes": "5", "lable": "tea"}), TOOLS)
    assert errs == [
        "arguments.minutes: '5' is not of type 'integer'",
        "arguments: 'label' is a required property",
        "arguments: unknown argument 'lable'",
    ]
    assert validate_call(ToolCall("set_light", {"room": "hall", "on": 1}), TOOLS) == [
        "arguments.on: 1 is not of type 'boolean'"]
    assert validate_call(ToolCall("get_weather", {"city": "Oslo", "unit": "kelvin"}), TOOLS) == [
        "arguments.unit: 'kelvin' is not one of ['celsius', 'fahrenheit']"]


def test_validate_call_respects_additional_properties_when_the_schema_sets_it():
    open_tool = _fn("f", {"a": {"type": "integer"}}, ["a"], additionalProperties=True)
    closed = _fn("f", {"a": {"type": "integer"}}, ["a"], additionalProperties=False)
    assert validate_call(ToolCall("f", {"a": 1, "b": 2}), [open_tool]) == []
    assert validate_call(ToolCall("f", {"a": 1, "b": 2}), [closed]) == [
        "arguments: Additional properties are not allowed ('b' was unexpected)"]


# ---------------------------------------------------------------------------- compare_calls


def test_compare_equal_and_string_normalisation():
    assert compare_calls([W], [W]).equal
    got = ToolCall("get_weather", {"city": "  paris. ", "unit": "Celsius"})
    assert compare_calls([got], [W], TOOLS).equal
    assert normalize_string("New-York, NY!") == normalize_string("new york ny")
    assert normalize_string("a+b") != normalize_string("ab")  # only the listed punctuation goes
    r = compare_calls([ToolCall("get_weather", {"city": "Paris", "unit": "fahrenheit"})], [W], TOOLS)
    assert not r.equal and r.reasons == ["call 0 get_weather: argument 'unit' 'fahrenheit' != 'celsius'"]


def test_compare_function_name_missing_and_extra_calls():
    r = compare_calls([ToolCall("get_time", {})], [W])
    assert r.reasons == ["call 0: function get_time != get_weather"]
    assert compare_calls([W], [W, T], TOOLS).reasons == ["missing call set_timer"]
    assert compare_calls([W, T], [W], TOOLS).reasons == ["extra call set_timer"]
    assert compare_calls([], []).equal


def test_compare_parallel_calls_order_free():
    assert compare_calls([T, W], [W, T], TOOLS).equal
    w2 = ToolCall("get_weather", {"city": "Oslo", "unit": "celsius"})
    assert compare_calls([w2, W], [W, w2], TOOLS).equal
    # one wrong argument among two same-name calls: the right one is matched, the other explained
    w3 = ToolCall("get_weather", {"city": "Rome", "unit": "celsius"})
    r = compare_calls([w3, W], [W, w2], TOOLS)
    assert r.reasons == ["call 1 get_weather: argument 'city' 'Rome' != 'Oslo'"]
    # the same call twice does not match two different wants
    assert compare_calls([W, W], [W, w2], TOOLS).reasons == ["call 1 get_weather: argument 'city' 'Paris' != 'Oslo'"]


def test_compare_int_float_and_bool():
    want = ToolCall("convert_currency", {"amount": 10.0, "from_currency": "USD", "to_currency": "EUR"})
    assert compare_calls([ToolCall("convert_currency", {**want.arguments, "amount": 10})], [want], TOOLS).equal
    near = {**want.arguments, "amount": 10.0 * (1 + 1e-12)}
    assert compare_calls([ToolCall("convert_currency", near)], [want], TOOLS).equal
    off = compare_calls([ToolCall("convert_currency", {**want.arguments, "amount": 10.01})], [want], TOOLS)
    assert off.reasons == ["call 0 convert_currency: argument 'amount' 10.01 != 10.0"]
    # a float where an integer is expected is a type error even when integral (BFCL rule)
    r = compare_calls([ToolCall("set_timer", {"minutes": 5.0, "label": "tea"})], [T], TOOLS)
    assert r.reasons == ["call 0 set_timer: argument 'minutes' type float != int"]
    # without a schema the type of want's value decides
    r = compare_calls([ToolCall("set_timer", {"minutes": 5.0, "label": "tea"})], [T])
    assert r.reasons == ["call 0 set_timer: argument 'minutes' type float != int"]
    # bool is not a number, and 1 is not True
    r = compare_calls([ToolCall("set_timer", {"minutes": True, "label": "tea"})], [T], TOOLS)
    assert r.reasons == ["call 0 set_timer: argument 'minutes' type bool != int"]
    light = ToolCall("set_light", {"room": "office", "on": True})
    r = compare_calls([ToolCall("set_light", {"room": "office", "on": 1})], [light], TOOLS)
    assert r.reasons == ["call 0 set_light: argument 'on' type int != bool"]
    r = compare_calls([ToolCall("set_timer", {"minutes": 5, "label": 5})], [T], TOOLS)
    assert r.reasons == ["call 0 set_timer: argument 'label' type int != str"]


def test_compare_required_unknown_and_defaults():
    tools = [_fn("search", {"q": {"type": "string"}, "n": {"type": "integer", "default": 10},
                            "lang": {"type": "string"}}, ["q"])]
    want = ToolCall("search", {"q": "cats"})
    assert compare_calls([ToolCall("search", {"q": "cats", "n": 10})], [want], tools).equal  # default
    assert compare_calls([ToolCall("search", {"q": "cats"})], [ToolCall("search", {"q": "cats", "n": 10})], tools).equal
    r = compare_calls([ToolCall("search", {"q": "cats", "n": 3})], [want], tools)
    assert r.reasons == ["call 0 search: argument 'n' 3 is not in the expected call"]
    r = compare_calls([ToolCall("search", {"q": "cats"})], [ToolCall("search", {"q": "cats", "lang": "en"})], tools)
    assert r.reasons == ["call 0 search: missing argument 'lang' (expected 'en')"]
    r = compare_calls([ToolCall("search", {"n": 10, "y": 1})], [want], tools)
    assert r.reasons == ["call 0 search: missing required argument 'q'", "call 0 search: unknown argument 'y'"]
    # without tools, want's arguments are the spec: all required, nothing else allowed
    r = compare_calls([ToolCall("search", {"n": 10})], [want])
    assert r.reasons == ["call 0 search: missing required argument 'q'", "call 0 search: unknown argument 'n'"]


def test_compare_nested_values():
    want = ToolCall("f", {"xs": [1, 2.5, "A b"], "o": {"k": [True]}})
    assert compare_calls([ToolCall("f", {"xs": [1.0, 2.5, "ab"], "o": {"k": [True]}})], [want]).equal
    assert not compare_calls([ToolCall("f", {"xs": [2.5, 1, "ab"], "o": {"k": [True]}})], [want]).equal
    assert not compare_calls([ToolCall("f", {"xs": [1, 2.5, "ab"], "o": {"k": [1]}})], [want]).equal
    assert values_equal(float("nan"), float("nan")) and not values_equal(None, 0)

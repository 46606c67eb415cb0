"""Closing in time, without a model: from a reply cut anywhere, the ending found completes its grammar
within its budget; and a grammar that can never end is known before it runs."""
import json

import jsonschema
import pytest

from server.engine.constraints import Grammars
from server.engine.grammar_ends import can_end

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 3}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}, "minItems": 2},
    "colour": {"enum": ["red", "green"]}, "home": {"type": "object", "properties": {"city": {"type": "string"}},
                                                   "required": ["city"]}},
    "required": ["name", "age", "tags", "colour", "home"]}
REPLY = '{"name": "Tom \\"the cat\\" {", "age": 7, "tags": ["a", "b"], "colour": "red", "home": {"city": "Paris"}}'


@pytest.fixture(scope="module")
def grammars(smollm):
    return Grammars(smollm.tokenizer, 8192)


def cut_at(grammars, grammar, text, n):
    """A constraint that has taken the first n tokens of `text`."""
    constraint = grammars.matcher(grammar)
    for token in grammars._tokenizer.encode(text, add_special=False)[:n]:
        constraint.accept(token)
        assert not constraint.matcher.is_error(), token
    return constraint


@pytest.mark.parametrize("schema", [SCHEMA, {"type": "object"}], ids=["schema", "json_object"])
def test_an_ending_from_every_cut_completes_the_schema(grammars, schema):
    grammar = grammars.json_schema(schema, "schema")
    tok = grammars._tokenizer
    ids = tok.encode(REPLY, add_special=False)
    for n in range(len(ids)):
        constraint = cut_at(grammars, grammar, REPLY, n)
        constraint.allowed(200)
        ending = constraint.ending_tokens
        assert ending is not None and len(ending) <= 40, (n, ending)
        text = tok.decode(ids[:n] + ending, skip_special=True)
        jsonschema.validate(json.loads(text), schema)  # parses, and matches the schema


def test_no_ending_is_claimed_when_none_fits(grammars):
    constraint = cut_at(grammars, grammars.json_schema(SCHEMA, "schema"), REPLY, 2)
    constraint.allowed(3)  # three tokens cannot hold the required keys
    assert constraint.ending_tokens is None


def test_a_sampled_token_that_would_leave_no_ending_is_replaced(grammars):
    tok = grammars._tokenizer
    constraint = cut_at(grammars, grammars.json_schema({"type": "object"}, "o"), '{"a": "hello', 99)
    constraint.allowed(2)
    ending = constraint.ending_tokens
    assert tok.decode(ending) == '"}', ending
    word = tok.encode(" world", add_special=False)[0]
    # with two tokens left, " world" would leave one token for `"}`: allowed only if one token closes it
    assert constraint.settle(word, 2, lambda: []) == word
    assert constraint.settle(word, 1, lambda: []) == ending[0]


def test_tool_calls_end_with_the_end_token(grammars):
    tok = grammars._tokenizer
    tool = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                  "required": ["city"]}}
    grammar = grammars.tool_calls([tool], parallel=True)
    constraint = cut_at(grammars, grammar, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa', 99)
    constraint.allowed(50)
    ending = constraint.ending_tokens
    assert ending[-1] in tok.eos_ids
    assert tok.decode(ending, skip_special=False).endswith('"}}\n</tool_call>' + tok.decode([ending[-1]], skip_special=False))


@pytest.mark.parametrize("lark, ends", [
    ('start: "a" start', False),
    ('start: ("a" | "c") start', False),
    ('start: x\nx: "a" x | "b" x', False),
    ('start: "a"~3 start', False),
    ('start: "a"{2,3} b\nb: c\nc: b', False),
    ('start: "a"+ "b"', True),
    ('start: x\nx: "ab" x | "c"', True),
    ('start: ("a" start)?', True),
    ('start: item+\nitem: /[a-z]+/ " "?', True),
    ('start: NUM\nNUM: /[0-9]+/', True),
    ('start: "a" "b" -> ab | start "c"', True),
    ('start: %json {"type": "object"}', None),  # not read: llguidance's own checks stand
    ('start: x', None),
])
def test_can_end_reads_the_rules(lark, ends):
    assert can_end(lark) is ends

"""Every real chat template in llama.cpp's models/templates/ (the sdist the suite already downloads), each
conversation of an agent's life, sent in each dialect's own shape: kvserve renders the same token ids as
transformers' apply_chat_template renders for the same chat, as transformers' documentation writes it
(tool calls with their arguments as objects, results with the call's id and the tool's name).

What differs is listed below with its reason; a listed case that comes to agree fails too, so the list
stays true. SmolLM2's vocabulary encodes both sides: a template's own control tokens are plain text in it,
which compares the rendered text all the same."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import llguidance
import pytest

from models.tokenizer import TextTokenizer
from server.api import anthropic, chat_render, ollama
from server.api.anthropic_schemas import CountTokensRequest
from server.errors import InvalidRequest
from server.api.ollama_schemas import OllamaChatRequest
from server.api.responses_chat import chat_request as responses_chat
from server.api.responses_items import input_items
from server.api.responses_schemas import ResponseRequest
from server.api.schemas import ChatCompletionRequest
from server.engine.constraints import Grammars

from ..models.gguf_files import llama_cpp_source

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}
ASK = ("user", "What is the weather in Paris?")
# a turn: (role, text); ("calls", [(id, name, arguments)], reasoning or None); ("result", id, name, text);
# ("reply", text, reasoning). A reply of calls alone has the empty text (OpenAI's clients send null, which
# Qwen3's and LFM2's templates fail on under transformers). Ids are Mistral's nine letters and digits, which its templates insist on.
CONVERSATIONS = {
    "plain": ([ASK], None),
    "system": ([("system", "Answer briefly."), ASK], None),
    "tools": ([ASK], [WEATHER]),
    "one_call": ([ASK, ("calls", [("callA0001", "get_weather", {"city": "Paris"})], None),
                  ("result", "callA0001", "get_weather", "sunny, 24 C")], [WEATHER]),
    "parallel": ([ASK, ("calls", [("callA0001", "get_weather", {"city": "Paris"}), ("callA0002", "get_time", {"city": "Paris"})],
                        None),
                  ("result", "callA0001", "get_weather", "sunny, 24 C"), ("result", "callA0002", "get_time", "10:00")],
                 [WEATHER, TIME]),
    "reasoning": ([ASK, ("reply", "Sunny.", "The user wants the weather."), ("user", "And in Rome?")], None),
    "agent_loop": ([("system", "You are a travel agent."), ASK,
                    ("calls", [("callA0001", "get_weather", {"city": "Paris"})], None),
                    ("result", "callA0001", "get_weather", "sunny, 24 C"),
                    ("calls", [("callA0002", "get_time", {"city": "Paris"})], None),
                    ("result", "callA0002", "get_time", "10:00"),
                    ("reply", "Sunny, and it is 10:00.", None), ("user", "And in Rome?")], [WEATHER, TIME]),
}
DIALECTS = ("openai", "responses", "anthropic", "ollama")
CALLS = ("one_call", "parallel", "agent_loop")

# (template, conversation or "*", dialect or "*") -> why kvserve renders otherwise, or transformers cannot
NO_TOOLS = "the template renders no tools: kvserve describes them, and earlier calls, in the Hermes format"
TEMPLATE_ERROR = "the template itself fails under transformers too; kvserve answers 400 with its message"
ARGUMENTS_AS_TEXT = TEMPLATE_ERROR + " (it adds a call's arguments to text: transformers' objects fail it)"
LISTED = {
    ("HuggingFaceTB-SmolLM3-3B", "*"): NO_TOOLS, ("microsoft-Phi-3.5-mini-instruct", "*"): NO_TOOLS,
    ("deepseek-ai-DeepSeek-R1-Distill-Llama-8B", "*"): NO_TOOLS, ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "*"): NO_TOOLS,
    ("deepseek-ai-DeepSeek-V3.1", "*"): NO_TOOLS, ("llama-cpp-deepseek-r1", "*"): NO_TOOLS,
    ("llama-cpp-rwkv-world", "*"): NO_TOOLS, ("google-gemma-2-2b-it", "*"): NO_TOOLS + "; it refuses a system role",
    ("CohereForAI-c4ai-command-r-plus-tool_use", "*"): TEMPLATE_ERROR + " (it needs tools, and a description of each)",
    ("fireworks-ai-llama-3-firefunction-v2", "*"): TEMPLATE_ERROR + " (it reads `functions`, not `tools`)",
    ("NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use", "*"): TEMPLATE_ERROR + " (it iterates `tools` unoffered)",
    ("NousResearch-Hermes-3-Llama-3.1-8B-tool_use", "*"): TEMPLATE_ERROR + " (it iterates `tools` unoffered)",
    ("meetkai-functionary-medium-v3.2", "one_call"): ARGUMENTS_AS_TEXT,
    ("meetkai-functionary-medium-v3.2", "parallel"): ARGUMENTS_AS_TEXT,
    ("meetkai-functionary-medium-v3.2", "agent_loop"): ARGUMENTS_AS_TEXT,
    ("Kimi-K2-Instruct", "*"): TEMPLATE_ERROR + " (list.append is unsafe in the sandbox)",
    ("Kimi-K2-Thinking", "*"): TEMPLATE_ERROR + " (list.append is unsafe in the sandbox)",
    ("meta-llama-Llama-3.1-8B-Instruct", "parallel"): TEMPLATE_ERROR + " (one call at a time)",
    ("meta-llama-Llama-3.2-3B-Instruct", "parallel"): TEMPLATE_ERROR + " (one call at a time)",
    ("meta-llama-Llama-3.3-70B-Instruct", "parallel"): TEMPLATE_ERROR + " (one call at a time)",
}


def listed(template: str, conversation: str, dialect: str) -> str | None:
    for key in ((template, "*"), (template, conversation), (template, conversation, dialect)):
        if key in LISTED:
            return LISTED[key]
    return None


def reference_messages(turns: list) -> list[dict]:
    """The chat as transformers' documentation writes it."""
    out = []
    for turn in turns:
        if turn[0] == "calls":
            calls = [{"id": i, "type": "function", "function": {"name": n, "arguments": a}} for i, n, a in turn[1]]
            out.append({"role": "assistant", "content": "", "tool_calls": calls,
                        **({"reasoning_content": turn[2]} if turn[2] else {})})
        elif turn[0] == "result":
            out.append({"role": "tool", "tool_call_id": turn[1], "name": turn[2], "content": turn[3]})
        elif turn[0] == "reply":
            out.append({"role": "assistant", "content": turn[1], **({"reasoning_content": turn[2]} if turn[2] else {})})
        else:
            out.append({"role": turn[0], "content": turn[1]})
    return out


def openai_request(turns: list, tools: list | None) -> ChatCompletionRequest:
    messages = []
    for turn in turns:
        if turn[0] == "calls":
            messages.append({"role": "assistant", "content": None, "reasoning_content": turn[2], "tool_calls": [
                {"id": i, "type": "function", "function": {"name": n, "arguments": json.dumps(a)}} for i, n, a in turn[1]]})
        elif turn[0] == "result":  # OpenAI's results name only the call
            messages.append({"role": "tool", "tool_call_id": turn[1], "content": turn[3]})
        elif turn[0] == "reply":
            messages.append({"role": "assistant", "content": turn[1], "reasoning_content": turn[2]})
        else:
            messages.append({"role": turn[0], "content": turn[1]})
    return ChatCompletionRequest(messages=messages, tools=tools)


def responses_request(turns: list, tools: list | None) -> ChatCompletionRequest:
    items = []
    for turn in turns:
        if turn[0] in ("calls", "reply") and turn[2]:
            items.append({"type": "reasoning", "id": "rs_1", "summary": [],
                          "content": [{"type": "reasoning_text", "text": turn[2]}]})
        if turn[0] == "calls":
            items += [{"type": "function_call", "call_id": i, "name": n, "arguments": json.dumps(a)} for i, n, a in turn[1]]
        elif turn[0] == "result":
            items.append({"type": "function_call_output", "call_id": turn[1], "output": turn[3]})
        elif turn[0] == "reply":
            items.append({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": turn[1]}]})
        else:
            items.append({"type": "message", "role": turn[0], "content": [{"type": "input_text", "text": turn[1]}]})
    body = ResponseRequest(input=items, tools=[{"type": "function", **t["function"]} for t in tools or []] or None)
    return responses_chat(body, input_items(body.input), thinks=False)


def anthropic_request(turns: list, tools: list | None) -> ChatCompletionRequest:
    system, messages = None, []
    for turn in turns:
        if turn[0] == "system":
            system = turn[1]
        elif turn[0] in ("calls", "reply"):
            blocks = [{"type": "thinking", "thinking": turn[2], "signature": ""}] if turn[2] else []
            blocks += [{"type": "text", "text": turn[1]}] if turn[0] == "reply" else [
                {"type": "tool_use", "id": i, "name": n, "input": a} for i, n, a in turn[1]]
            messages.append({"role": "assistant", "content": blocks})
        elif turn[0] == "result":
            result = {"type": "tool_result", "tool_use_id": turn[1], "content": turn[3]}
            if messages and messages[-1]["role"] == "user" and isinstance(messages[-1]["content"], list):
                messages[-1]["content"].append(result)
            else:
                messages.append({"role": "user", "content": [result]})
        else:
            messages.append({"role": "user", "content": turn[1]})
    body = CountTokensRequest(model="m", system=system, messages=messages, tools=[
        {"name": t["function"]["name"], "description": t["function"]["description"],
         "input_schema": t["function"]["parameters"]} for t in tools or []] or None)
    return anthropic.chat_request(body)


def ollama_request(turns: list, tools: list | None) -> ChatCompletionRequest:
    messages = []
    for turn in turns:
        if turn[0] == "calls":
            messages.append({"role": "assistant", "content": "", "thinking": turn[2], "tool_calls": [
                {"id": i, "function": {"name": n, "arguments": a}} for i, n, a in turn[1]]})
        elif turn[0] == "result":
            messages.append({"role": "tool", "tool_name": turn[2], "content": turn[3]})
        elif turn[0] == "reply":
            messages.append({"role": "assistant", "content": turn[1], "thinking": turn[2]})
        else:
            messages.append({"role": turn[0], "content": turn[1]})
    return ollama.chat_request(OllamaChatRequest(model="m", messages=messages, tools=tools), None)


REQUESTS = {"openai": openai_request, "responses": responses_request, "anthropic": anthropic_request,
            "ollama": ollama_request}


@pytest.fixture(scope="module")
def templates() -> Path:
    return llama_cpp_source() / "models" / "templates"


def template_names() -> list[str]:
    """The templates of the sdist's llama.cpp (listed at collection: the folder is fetched by then or not)."""
    try:
        folder = llama_cpp_source() / "models" / "templates"
    except Exception:  # noqa: BLE001 - collected without the network: the test then fails in its fixture
        return ["Qwen-Qwen3-0.6B"]
    return sorted(p.stem for p in folder.glob("*.jinja"))


def both_tokenizers(smollm, source: str):
    """SmolLM2's vocabulary under the template `source`: kvserve's tokenizer and transformers' (the reference)."""
    from transformers import PreTrainedTokenizerFast

    base = smollm.tokenizer
    hf = PreTrainedTokenizerFast(tokenizer_object=base.tokenizer, bos_token=base.meta.bos_token,
                                 eos_token=base.meta.eos_token)
    hf.chat_template = source
    return TextTokenizer(base.tokenizer, dataclasses.replace(base.meta, chat_template=source)), hf


@pytest.mark.parametrize("template", template_names())
def test_every_conversation_in_every_dialect_renders_as_transformers_renders_it(template, templates, smollm):
    tok, hf = both_tokenizers(smollm, (templates / f"{template}.jinja").read_text())
    unexpected, agreed_listed = [], []
    for name, (turns, tools) in CONVERSATIONS.items():
        for dialect in DIALECTS:
            why = listed(template, name, dialect)
            # Anthropic's requests say whether to think: without `thinking`, the template's switch is off
            kwargs = {"enable_thinking": False} if dialect == "anthropic" else {}
            try:
                want = hf.apply_chat_template(reference_messages(turns), tools=tools, add_generation_prompt=True,
                                              tokenize=True, return_dict=False, **kwargs)
            except Exception as e:  # noqa: BLE001 - the template's own failure: listed, or a finding
                want = f"transformers fails: {e}"
            try:
                got = chat_render.render_chat(tok, REQUESTS[dialect](turns, tools)).ids
            except InvalidRequest as e:
                got = f"kvserve answers 400: {e}"
            if got == want and why is not None and isinstance(want, list):
                agreed_listed.append((name, dialect))
            elif got != want and why is None:
                unexpected.append((name, dialect, _first_difference(tok, got, want)))
    assert not unexpected, f"{template}: renders otherwise than transformers: {unexpected}"
    if any(key[0] == template for key in LISTED) and LISTED.get((template, "*")) is None:
        assert not agreed_listed, f"{template}: listed, but agrees: {agreed_listed}"


def _first_difference(tok: TextTokenizer, got, want) -> str:
    if isinstance(got, str) or isinstance(want, str):
        return f"{str(got)[:120]} | {str(want)[:120]}"
    a, b = tok.decode(got, skip_special=False), tok.decode(want, skip_special=False)
    at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"at {at}: kvserve {a[max(0, at - 40):at + 60]!r} | transformers {b[max(0, at - 40):at + 60]!r}"


# the templates of the families kvserve serves whose models write calls of their own format
ROUND_TRIPS = ("Qwen-Qwen3-0.6B", "Qwen-Qwen2.5-7B-Instruct", "Qwen-QwQ-32B", "Qwen3-Coder", "Qwen3.5-4B",
               "meta-llama-Llama-3.1-8B-Instruct", "meta-llama-Llama-3.2-3B-Instruct", "meta-llama-Llama-3.3-70B-Instruct",
               "mistralai-Mistral-Nemo-Instruct-2407", "Mistral-Small-3.2-24B-Instruct-2506",
               "mistralai-Ministral-3-14B-Reasoning-2512", "unsloth-mistral-Devstral-Small-2507", "openai-gpt-oss-120b",
               "ibm-granite-granite-4.0", "NousResearch-Hermes-3-Llama-3.1-8B-tool_use", "LFM2.5-8B-A1B")
# where a model's turn ends: a stop token, not part of the text it wrote
TURN_ENDS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "</s>", "<|end_of_text|>", "<|return|>", "<|call|>", "<|end|>")


@pytest.mark.parametrize("template", ROUND_TRIPS)
def test_a_call_written_in_the_models_format_comes_back_structured_and_renders_as_written(template, templates, smollm):
    """The call as the template writes it is what the model was trained to write: read back, it is the call,
    and sent back in the next request it renders the same text again."""
    tok, hf = both_tokenizers(smollm, (templates / f"{template}.jinja").read_text())
    turns, tools = CONVERSATIONS["one_call"]
    asked, called = reference_messages(turns[:1]), reference_messages(turns[:2])
    prompt = hf.apply_chat_template(asked, tools=tools, add_generation_prompt=True, tokenize=False)
    whole = hf.apply_chat_template(called, tools=tools, add_generation_prompt=False, tokenize=False)
    thought = ""
    for opened, rest in (("<think>\n</think>", "\n\n"), ("<think>\n", "I will look it up.\n</think>\n\n")):
        if prompt.endswith(opened) and not whole.startswith(prompt):
            # (QwQ opens the think block in its prompt, or opens and closes it, and drops past reasoning
            # from the history: the model writes what closes it, then calls)
            prompt, thought = prompt.removesuffix(opened), rest
    assert whole.startswith(prompt), f"{template}: the turn does not continue its generation prompt"
    written = thought + whole[len(prompt):].rstrip()
    while any(written.endswith(end) for end in TURN_ENDS):
        written = written[:-len(next(end for end in TURN_ENDS if written.endswith(end)))].rstrip()
    written = written.removeprefix("<|channel|>final<|message|>")  # (gpt-oss's turn names its channel first)

    request = openai_request(turns[:1], tools)
    reply = chat_render.render_chat(tok, request).reader.parse([written])
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in reply.calls] == \
        [("get_weather", {"city": "Paris"})], f"{template}: {written!r} read as {reply}"

    again = ChatCompletionRequest(messages=[*request.model_dump(exclude_none=True)["messages"], {
        "role": "assistant", "content": reply.content, "reasoning_content": reply.reasoning, "tool_calls": reply.calls}],
        tools=tools, add_generation_prompt=False)
    rendered = tok.decode(chat_render.render_chat(tok, again).ids, skip_special=False)
    call_text = written.split("</think>")[-1].lstrip()  # an empty think block is the template's, not the call's
    assert call_text in rendered, f"{template}: wrote {call_text!r}; sent back, it renders {rendered[-300:]!r}"

    # and a forced reply's grammar has the model write the call just so, in its own format
    grammars = Grammars(tok, 4096)
    offered = [{"name": t["function"]["name"], "parameters": t["function"]["parameters"]} for t in tools]
    forced = grammars.tool_calls(offered, True, chat_render.render_chat(tok, request).reader.format.forced)
    matcher = llguidance.LLMatcher(grammars.ll_tokenizer, forced, log_level=0)
    call_text = written.split("</think>")[-1].lstrip("\n")  # (harmony's header starts with a space)
    assert matcher.consume_tokens(tok.encode(call_text, add_special=False)), f"{template}: {matcher.get_error()}"
    ends = [end for end in ("", *TURN_ENDS) if _accepts(matcher.deep_copy(), tok.encode(end, add_special=False))]
    assert ends, f"{template}: the grammar wants more than {call_text!r}"


def _accepts(matcher, ids: list[int]) -> bool:
    return matcher.consume_tokens(ids) and matcher.is_accepting()


def test_a_template_that_reads_xml_tools_gets_the_tools_there(smollm):
    """SmolLM3's template takes its tools as `xml_tools` (its model card passes them so): rendered as
    transformers renders it given them there."""
    source = ("{%- if xml_tools %}<tools>{% for tool in xml_tools %}{{ tool | tojson }}\n{% endfor %}</tools>{% endif %}"
              "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
              "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok, hf = both_tokenizers(smollm, source)
    turns, tools = CONVERSATIONS["tools"]
    want = hf.apply_chat_template(reference_messages(turns), xml_tools=tools, add_generation_prompt=True, tokenize=False)
    got = tok.decode(chat_render.render_chat(tok, openai_request(turns, tools)).ids, skip_special=False)
    assert got == want and '"get_weather"' in got

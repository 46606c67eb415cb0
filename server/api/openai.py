"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models."""
from __future__ import annotations

import asyncio
import secrets
import time

from fastapi import APIRouter
from fastapi import Request as HttpRequest
from fastapi.responses import StreamingResponse

from ..engine.constraints import Grammars
from ..engine.sampling import SamplingParams
from ..engine.sequence import Finished, Scheduling, Sequence, TokenEvent
from ..errors import InvalidRequest
from . import generation, tools
from .tool_stream import ToolCallStream
from .schemas import ERROR_RESPONSES, ChatCompletionRequest, CompletionRequest, _OpenAISampling

router = APIRouter(tags=["openai"], responses=ERROR_RESPONSES)

# "timeout": the request's deadline passed while it ran (its `timeout`, or --request-timeout)
OPENAI_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "timeout": "timeout", "cancelled": "length",
                  "error": "error"}


def _finish_reason(reason: str, calls: int) -> str:
    """A reply with complete tool calls finishes with tool_calls, unless max_tokens or its deadline cut it."""
    return "tool_calls" if calls and reason not in ("length", "timeout") else OPENAI_REASONS[reason]


def _delta(content: str | None, tool_calls: list[dict]) -> dict:
    """A streamed chat delta: its text and its tool-call deltas, each only if there are any."""
    return {**({"content": content} if content else {}), **({"tool_calls": tool_calls} if tool_calls else {})}


def openai_params(body: _OpenAISampling, max_tokens: int | None, logprobs: int | None, vocab: int,
                  grammar: str | None = None) -> SamplingParams:
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=body.temperature if body.temperature is not None else 1.0,
        top_k=body.top_k if body.top_k and body.top_k > 0 else 0,
        top_p=body.top_p if body.top_p is not None else 1.0,
        min_p=body.min_p or 0.0,
        repetition_penalty=body.repetition_penalty or 1.0,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        seed=body.seed % 2**63 if body.seed is not None else None,
        stop=stop,
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        logit_bias=_logit_bias(body.logit_bias or {}, vocab),
        grammar=grammar,
    )


def _logit_bias(bias: dict[str, float], vocab: int) -> tuple[tuple[int, float], ...]:
    out = []
    for key, value in bias.items():
        if not key.lstrip("-").isdigit() or not 0 <= int(key) < vocab:
            raise InvalidRequest(f"logit_bias key {key!r} is not a token id (0..{vocab - 1})", param="logit_bias")
        out.append((int(key), value))
    return tuple(out)


def _output_grammar(grammars: Grammars, body: _OpenAISampling, tool_functions: list[dict] | None) -> str | None:
    """The grammar the output must match, from whichever one field asks for it (None: free text)."""
    rf = body.response_format
    asked = {
        "tool_choice": tool_functions is not None,
        "response_format": rf is not None and rf.type != "text",
        "guided_json": body.guided_json is not None,
        "guided_regex": (body.guided_regex or body.regex) is not None,
        "guided_grammar": (body.guided_grammar or body.grammar) is not None,
        "guided_choice": body.guided_choice is not None,
    }
    named = [k for k, v in asked.items() if v]
    if len(named) > 1:
        raise InvalidRequest(f"only one output constraint at a time; got {', '.join(named)}", param=named[1])
    if not named:
        return None
    param = named[0]
    if tool_functions is not None:
        grammar = grammars.tool_calls(tool_functions, body.parallel_tool_calls)
    elif rf is not None and rf.type == "json_object":
        grammar = grammars.json_schema({"type": "object"}, param)
    elif rf is not None:
        if rf.json_schema is None:
            raise InvalidRequest("response_format json_schema needs a json_schema", param="response_format.json_schema")
        grammar = grammars.json_schema(rf.json_schema.schema_, "response_format.json_schema")
    elif body.guided_json is not None:
        grammar = grammars.json_schema(body.guided_json, param)
    elif param == "guided_regex":
        grammar = grammars.regex(body.guided_regex or body.regex)
    elif param == "guided_grammar":
        grammar = grammars.lark(body.guided_grammar or body.grammar, param)
    else:
        grammar = grammars.choice(body.guided_choice)
    return grammars.check(grammar, param)


def _start(http: HttpRequest, body: _OpenAISampling, prompt: list[int], max_tokens: int | None,
           logprobs: int | None, tool_functions: list[dict] | None = None) -> list[Sequence]:
    generation.check_model(http, body.model)
    engine = generation.engine_of(http)
    grammar = _output_grammar(engine.grammars, body, tool_functions)
    params = openai_params(body, max_tokens, logprobs, engine.model.config.vocab_size, grammar)
    if len(params.stop) > engine.config.max_stop_strings:
        raise InvalidRequest(f"at most {engine.config.max_stop_strings} stop strings are allowed", param="stop")
    return generation.start(
        http, generation.session_id_of(http, body.session_id), prompt, params,
        resend=True, n=body.n, scheduling=Scheduling(body.priority, body.timeout),
    )


def _usage(finished: list[Finished]) -> dict:
    """One prompt, however many choices: its tokens (and the cached part) count once."""
    first, completion = finished[0], sum(f.completion_tokens for f in finished)
    return {
        "prompt_tokens": first.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": first.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": first.cached_tokens},
    }


def _chat_logprobs(tok, events: list[TokenEvent]) -> dict:
    def entry(token_id, logprob):
        text = tok.decode([token_id], skip_special=False)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**entry(e.token, e.logprob), "top_logprobs": [entry(i, lp) for i, lp in e.top]} for e in events]}


def _completion_logprobs(tok, events: list[TokenEvent], offset: int = 0) -> dict:
    tokens = [tok.decode([e.token], skip_special=False) for e in events]
    offsets, at = [], offset
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in events],
        "top_logprobs": [{tok.decode([i], skip_special=False): lp for i, lp in e.top} for e in events],
        "text_offset": offsets,
    }


def _response(http: HttpRequest, kind: str, finished: list[Finished], choices: list[dict]) -> dict:
    """A whole (non-streamed) completion or chat completion."""
    return {
        "id": ("chatcmpl-" if kind == "chat" else "cmpl-") + secrets.token_hex(12),
        "object": "chat.completion" if kind == "chat" else "text_completion",
        "created": int(time.time()),
        "model": http.app.state.config.model_name,
        "choices": [{"index": i, "finish_reason": OPENAI_REASONS[f.reason], **choice}
                    for i, (choice, f) in enumerate(zip(choices, finished))],
        "usage": _usage(finished),
    }


async def _collect_all(http: HttpRequest, reqs: list[Sequence]) -> list[tuple[list[TokenEvent], Finished]]:
    return list(await asyncio.gather(*(generation.collect(http, r) for r in reqs)))


class _Stream:
    """Turns engine events of one request's choices into OpenAI SSE chunks."""

    def __init__(self, http, reqs, body, kind: str, make_choice, want_logprobs: bool, make_final=None) -> None:
        self.http, self.reqs, self.body, self.make_choice, self.want_logprobs = http, reqs, body, make_choice, want_logprobs
        # the last chunks of a choice (by default, its tail text and finish reason)
        self.make_final = make_final or (lambda i, f: [make_choice(i, f.text, None, OPENAI_REASONS[f.reason])])
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + secrets.token_hex(12)
        self.object = "chat.completion.chunk" if kind == "chat" else "text_completion"
        self.created, self.model = int(time.time()), http.app.state.config.model_name

    def chunk(self, choices: list, usage: dict | None = None) -> str:
        out = {"id": self.id, "object": self.object, "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return generation.sse(out)

    async def _events(self):
        if len(self.reqs) == 1:  # no task per choice on the common path
            async for event in generation.events(self.http, self.reqs[0], watch_disconnect=False):
                yield 0, event
        else:
            async for pair in generation.merged(self.http, self.reqs):
                yield pair

    async def __aiter__(self):
        for i in range(len(self.reqs)):
            first = self.make_choice(i, None, None, None, first=True)
            if first is not None:
                yield self.chunk([first])
        finished: list[Finished | None] = [None] * len(self.reqs)
        async for i, event in self._events():
            if isinstance(event, TokenEvent):
                choice = self.make_choice(i, event.text, event if self.want_logprobs else None, None)
                if choice is not None:
                    yield self.chunk([choice])
                continue
            if event.error is not None:
                yield generation.sse_error(event.error)
                return
            if event.last is not None:  # the token that ended the choice comes with its end
                choice = self.make_choice(i, event.last.text, event.last if self.want_logprobs else None, None)
                if choice is not None:
                    yield self.chunk([choice])
            finished[i] = event
            for choice in self.make_final(i, event):
                yield self.chunk([choice])
        opts = self.body.stream_options
        if opts is not None and opts.include_usage:
            yield self.chunk([], _usage(finished))
        yield generation.sse("[DONE]")


@router.post("/v1/completions")
async def completions(body: CompletionRequest, http: HttpRequest):
    tok = generation.engine_of(http).tokenizer
    prompt = body.prompt if isinstance(body.prompt, list) else tok.encode(body.prompt)
    reqs = _start(http, body, prompt, body.max_tokens, body.logprobs)
    echo = (body.prompt if isinstance(body.prompt, str) else tok.decode(body.prompt)) if body.echo else ""
    if body.stream:
        def choice(i, text, event, reason, first=False):
            if first:
                return {"index": i, "text": echo, "logprobs": None, "finish_reason": None} if echo else None
            if not text and event is None and reason is None:
                return None
            lp = _completion_logprobs(tok, [event]) if event is not None else None
            return {"index": i, "text": text or "", "logprobs": lp, "finish_reason": reason}

        return StreamingResponse(_Stream(http, reqs, body, "completion", choice, body.logprobs is not None).__aiter__(),
                                 media_type="text/event-stream", headers=generation.SSE_HEADERS)
    results = await _collect_all(http, reqs)
    choices = [{"text": echo + f.output,
                "logprobs": _completion_logprobs(tok, events, len(echo)) if body.logprobs is not None else None}
               for events, f in results]
    return _response(http, "completion", [f for _, f in results], choices)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, http: HttpRequest):
    tok = generation.engine_of(http).tokenizer
    messages, template_tools = tools.chat_messages(body, tok.template_has_tools)
    text = tok.apply_chat_template(messages, body.add_generation_prompt, template_tools)
    prompt = tok.encode(text, add_special=False)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    forced = tools.forced_tools(body)
    reqs = _start(http, body, prompt, max_tokens, logprobs, forced)
    names = {t.function.name for t in body.tools or []} if tools.offers_tools(body) else set()
    if body.stream:
        calls = [ToolCallStream(names, forced is not None) if names else None for _ in reqs]

        def choice(i, text, event, reason, first=False):
            if first:
                return {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            deltas: list[dict] = []
            if calls[i] is not None:
                text, deltas = calls[i].feed(text or "")
            if not text and not deltas and event is None and reason is None:
                return None
            lp = _chat_logprobs(tok, [event]) if event is not None else None
            return {"index": i, "delta": _delta(text, deltas), "logprobs": lp, "finish_reason": reason}

        def final(i, f: Finished):
            if calls[i] is None:
                return [choice(i, f.text, None, OPENAI_REASONS[f.reason])]
            last = choice(i, f.text, None, None)
            delta = _delta(*calls[i].finish())
            out = [c for c in (last, {"index": i, "delta": delta, "logprobs": None, "finish_reason": None} if delta else None) if c]
            return [*out, {"index": i, "delta": {}, "logprobs": None, "finish_reason": _finish_reason(f.reason, calls[i].complete)}]

        return StreamingResponse(_Stream(http, reqs, body, "chat", choice, body.logprobs, final).__aiter__(),
                                 media_type="text/event-stream", headers=generation.SSE_HEADERS)
    results = await _collect_all(http, reqs)
    choices = []
    for events, f in results:
        content, calls = tools.parse_tool_calls(f.output, names, forced is not None) if names else (f.output, [])
        message = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
        choices.append({"message": message, "logprobs": _chat_logprobs(tok, events) if body.logprobs else None,
                        "finish_reason": _finish_reason(f.reason, len(calls))})
    return _response(http, "chat", [f for _, f in results], choices)


@router.get("/v1/models")
async def models(http: HttpRequest) -> dict:
    engine = generation.engine_of(http)
    return {"object": "list", "data": [{
        "id": http.app.state.config.model_name,
        "object": "model",
        "created": http.app.state.started,
        "owned_by": "kvserve",
        "max_model_len": engine.max_context,
    }]}

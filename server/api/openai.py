"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models and /v1/models/{id}."""
from __future__ import annotations

import asyncio
import dataclasses
import secrets
import time

from fastapi import APIRouter
from fastapi import Request as HttpRequest
from fastapi.responses import StreamingResponse

from models.tokenizer import TextTokenizer

from ..engine.constraints import Grammars
from ..engine.forced_calls import Layout, hermes
from ..engine.sampling import SamplingParams
from ..engine.sequence import Finished, Scheduling, Sequence, TokenEvent
from ..errors import InvalidRequest, NotFound, quoted
from . import chat_choices, chat_render, generation, model_names, tool_formats, tools
from .choice_stream import OPENAI_REASONS, ChoiceStream, usage
from .schemas import ERROR_RESPONSES, ChatCompletionRequest, CompletionRequest, _OpenAISampling
from .tokenize_schemas import TokenizeRequest

router = APIRouter(tags=["openai"], responses=ERROR_RESPONSES)


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


def output_grammar(grammars: Grammars, body: _OpenAISampling, tool_functions: list[dict] | None,
                   layout: Layout = hermes) -> str | None:
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
        grammar = grammars.tool_calls(tool_functions, tools.parallel_calls(body), layout)
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


async def _params(http: HttpRequest, body: _OpenAISampling, max_tokens: int | None, logprobs: int | None,
            tool_functions: list[dict] | None = None, layout: Layout = hermes) -> SamplingParams:
    generation.check_model(http, body.model)
    engine = generation.engine_of(http)
    grammar = await asyncio.to_thread(output_grammar, engine.grammars, body, tool_functions, layout)  # compiles: off the loop
    params = openai_params(body, max_tokens, logprobs, engine.model.config.vocab_size, grammar)
    generation.check_stops(http, params.stop, "stop")
    return params


def _start_prompts(http: HttpRequest, body: _OpenAISampling, prompts: list[list[int]],
                   params: SamplingParams) -> list[Sequence]:
    """Each prompt's n choices, in order (choice index = prompt index * n + choice). A prompt refused
    cancels those started before it: the request runs whole or not at all."""
    session_id = generation.session_id_of(http, body.session_id)
    if len(prompts) > 1 and session_id is not None:
        raise InvalidRequest("a list of prompts runs each on temporary sessions; send it without a session id",
                             param="prompt")
    reqs: list[Sequence] = []
    try:
        for prompt in prompts:
            reqs += generation.start(http, session_id, prompt, params, resend=True, n=body.n,
                                     scheduling=Scheduling(body.priority, body.timeout, body.speculative, body.cache_salt))
    except Exception:
        for req in reqs:
            generation.engine_of(http).cancel(req)
        raise
    return reqs


def chat_prompt(tok: TextTokenizer, body: ChatCompletionRequest | TokenizeRequest, add_special: bool = False) -> list[int]:
    """The prompt ids of a chat: its messages and tools through the chat template (the chat route's and /tokenize's)."""
    return chat_render.render_chat(tok, body, add_special).ids


def _chat_logprobs(tok, events: list[TokenEvent]) -> dict:
    def entry(token_id, logprob):
        text = tok.decode([token_id], skip_special=False)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**entry(e.token, e.logprob), "top_logprobs": [entry(i, lp) for i, lp in e.top]} for e in events]}


def _completion_logprobs(tok, events: list[TokenEvent], offset: int = 0, prompt: list[int] = (),
                         scores: list | None = None) -> dict:
    """The generated tokens' logprobs, after those of the echoed `prompt` (whose first token has none, nor
    has any where the first choice ended before scoring it) if given, with text offsets from `offset`."""
    scores = scores or [None] * len(prompt)
    rows = [(t, None, None) if s is None else (t, s.logprob, s.top) for t, s in zip(prompt, scores)]
    rows += [(e.token, e.logprob, e.top) for e in events]
    tokens = [tok.decode([t], skip_special=False) for t, _, _ in rows]
    offsets, at = [], offset
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [lp for _, lp, _ in rows],
        "top_logprobs": [{tok.decode([i], skip_special=False): lp for i, lp in top} if top is not None else None
                         for _, _, top in rows],
        "text_offset": offsets,
    }


def _response(http: HttpRequest, kind: str, finished: list[Finished], choices: list[dict], n: int) -> dict:
    """A whole (non-streamed) completion or chat completion, of n choices per prompt."""
    return {
        "id": ("chatcmpl-" if kind == "chat" else "cmpl-") + secrets.token_hex(12),
        "object": "chat.completion" if kind == "chat" else "text_completion",
        "created": int(time.time()),
        "model": http.app.state.config.model_name,
        "choices": [{"index": i, "finish_reason": OPENAI_REASONS[f.reason], **choice}
                    for i, (choice, f) in enumerate(zip(choices, finished))],
        "usage": usage(finished, n),
    }


async def _collect_all(http: HttpRequest, reqs: list[Sequence]) -> list[tuple[list[TokenEvent], Finished]]:
    return list(await asyncio.gather(*(generation.collect(http, r) for r in reqs)))


def prompts_of(prompt: str | list) -> list[str | list[int]]:
    """A list of strings or of id lists is several prompts; a list of ids is one."""
    return prompt if isinstance(prompt, list) and isinstance(prompt[0], (str, list)) else [prompt]


def prompt_ids(tok, prompts: list[str | list[int]]) -> list[list[int]]:
    """The ids each completion prompt runs on: a string encoded, an id list as sent."""
    return [tok.encode(p) if isinstance(p, str) else p for p in prompts]


@router.post("/v1/completions")
async def completions(body: CompletionRequest, http: HttpRequest):
    tok = generation.engine_of(http).tokenizer
    prompts = prompts_of(body.prompt)
    ids = prompt_ids(tok, prompts)
    scoring = body.echo and body.logprobs is not None  # the echoed prompt comes with its logprobs too
    params = await _params(http, body, body.max_tokens, body.logprobs)
    reqs = _start_prompts(http, body, ids, dataclasses.replace(params, prompt_logprobs=body.logprobs) if scoring else params)
    # choice i answers prompt i // n; ids decode only once the engine has checked them
    echoes = [(p if isinstance(p, str) else tok.decode(p)) if body.echo else "" for p in prompts]
    if body.stream:
        def choice(i, text, event, reason, first=False):
            if first:
                echo = echoes[i // body.n]
                lp = _completion_logprobs(tok, [], 0, ids[i // body.n], reqs[i].prompt_logprobs) if scoring else None
                return {"index": i, "text": echo, "logprobs": lp, "finish_reason": None} if echo else None
            if not text and event is None and reason is None:
                return None
            lp = _completion_logprobs(tok, [event]) if event is not None else None
            return {"index": i, "text": text or "", "logprobs": lp, "finish_reason": reason}

        # a scored prompt is known by the choice's first event: its echo waits for it
        stream = ChoiceStream(http, reqs, body, "completion", choice, body.logprobs is not None, first_waits=scoring)
        return StreamingResponse(stream.__aiter__(), media_type="text/event-stream", headers=generation.SSE_HEADERS)
    results = await _collect_all(http, reqs)
    choices = []
    for i, (events, f) in enumerate(results):
        echo = echoes[i // body.n]
        if scoring:
            lp = _completion_logprobs(tok, events, 0, ids[i // body.n], reqs[i].prompt_logprobs)
        else:
            lp = _completion_logprobs(tok, events, len(echo)) if body.logprobs is not None else None
        choices.append({"text": echo + f.output, "logprobs": lp})
    return _response(http, "completion", [f for _, f in results], choices, body.n)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, http: HttpRequest):
    tok = generation.engine_of(http).tokenizer
    rendered = chat_render.render_chat(tok, body)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = await _params(http, body, max_tokens, logprobs, tools.forced_tools(body), rendered.reader.format.forced)
    reader = rendered.reader if params.grammar is None else rendered.reader.constrained()
    reqs = _start_prompts(http, body, [rendered.ids], reader.sampling(params))
    if body.stream:
        streamed = chat_choices.StreamedChoices(reader, len(reqs), lambda event: _chat_logprobs(tok, [event]))
        stream = ChoiceStream(http, reqs, body, "chat", streamed.choice, body.logprobs, streamed.final)
        return StreamingResponse(stream.__aiter__(), media_type="text/event-stream", headers=generation.SSE_HEADERS)
    results = await _collect_all(http, reqs)
    choices = []
    for events, f in results:
        reply = reader.parse([f.output])
        choices.append({"message": chat_choices.message(reader, reply),
                        "logprobs": _chat_logprobs(tok, events) if body.logprobs else None,
                        "finish_reason": chat_choices.finish_reason(f.reason, len(reply.calls))})
    return _response(http, "chat", [f for _, f in results], choices, body.n)


def _model(http: HttpRequest, name: str) -> dict:
    return {
        "id": name,
        "object": "model",
        "created": http.app.state.started,
        "owned_by": "kvserve",
        "max_model_len": generation.engine_of(http).max_context,
        "tensor_types": dict(generation.engine_of(http).model.held),  # what it holds, as stored unless --weights asked
        "chat_template": _template_info(generation.engine_of(http).tokenizer),
    }


def _template_info(tok) -> dict:
    """How tools reach the model: written by its template in its own format, or, for a template that has
    none, described by kvserve in the Hermes format (and earlier calls and results written so)."""
    return {"tool_format": tool_formats.format_for(tok.meta.chat_template).name,
            "tools_written_by": "template" if tok.template_has_tools else "kvserve"}


@router.get("/v1/models")
async def models(http: HttpRequest) -> dict:
    """The primary name first, then each alias, one entry each (as vLLM lists its served names)."""
    return {"object": "list", "data": [_model(http, name) for name in model_names.served_names(http.app.state.config)]}


@router.get("/v1/models/{model_id:path}")  # a served name may hold "/" (org/model)
async def model(model_id: str, http: HttpRequest) -> dict:
    config = http.app.state.config
    name = model_names.resolve(config, model_id)
    if name is None:
        raise NotFound(f"the model {quoted(model_id)} does not exist; this server serves {config.model_name!r}",
                       param="model")
    return _model(http, name)

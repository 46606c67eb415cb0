"""TGI-compatible routes: /generate, /generate_stream, and / (which picks one by `stream`)."""
from __future__ import annotations

import asyncio

from fastapi import APIRouter
from fastapi import Request as HttpRequest
from fastapi.responses import StreamingResponse

from ..engine.constraints import Grammars
from ..engine.sampling import SamplingParams
from ..engine.sequence import Finished, Scheduling, Sequence, TokenEvent
from ..errors import InvalidRequest
from . import generation
from .schemas import ERROR_RESPONSES, GenerateParameters, GenerateRequest

router = APIRouter(tags=["tgi"], responses=ERROR_RESPONSES)

TGI_REASONS = {"eos": "eos_token", "stop": "stop_sequence", "length": "length", "timeout": "timeout",
               "cancelled": "length", "error": "length",
               "shutdown": "abort",  # the server's drain ended it (as the OpenAI routes say; TGI has no such reason)
               "unmet": "length"}  # TGI has no reason for output that missed its grammar: it is incomplete


def tgi_grammar(grammars: Grammars, p: GenerateParameters) -> str | None:
    """TGI's `grammar` parameter -> an llguidance grammar (None: free text)."""
    g = p.grammar
    if g is None:
        return None
    if g.type == "regex":
        if not isinstance(g.value, str):
            raise InvalidRequest("a regex grammar's value must be a string", param="parameters.grammar.value")
        return grammars.check(grammars.regex(g.value), "parameters.grammar")
    return grammars.check(grammars.json_schema(g.value, "parameters.grammar.value"), "parameters.grammar")


def tgi_params(p: GenerateParameters, grammar: str | None = None) -> SamplingParams:
    sampling = p.do_sample or any(v is not None for v in (p.temperature, p.top_k, p.top_p))
    temperature = 0.0 if not sampling else (p.temperature if p.temperature is not None else 1.0)
    return SamplingParams(
        max_tokens=p.max_new_tokens,
        temperature=temperature,
        top_k=p.top_k or 0,
        top_p=p.top_p if p.top_p is not None else 1.0,
        min_p=p.min_p or 0.0,
        repetition_penalty=p.repetition_penalty or 1.0,
        frequency_penalty=p.frequency_penalty or 0.0,
        presence_penalty=p.presence_penalty or 0.0,
        seed=p.seed,
        stop=tuple(p.stop),
        logprobs=p.top_n_tokens or 0,
        grammar=grammar,
    )


async def _start(http: HttpRequest, body: GenerateRequest) -> Sequence:
    engine = generation.engine_of(http)
    generation.check_stops(http, tuple(body.parameters.stop), "parameters.stop")
    grammar = await asyncio.to_thread(tgi_grammar, engine.grammars, body.parameters)  # compiles: off the loop
    params = tgi_params(body.parameters, grammar)
    prompt = engine.tokenizer.encode(body.inputs)
    if body.parameters.truncate is not None:
        prompt = prompt[-body.parameters.truncate :]
    return generation.start(
        http,
        generation.session_id_of(http, body.session_id),
        prompt,
        params,
        resend=False,
        scheduling=Scheduling(body.parameters.priority, body.parameters.timeout, body.parameters.speculative),
    )[0]


def _token(tokenizer, e: TokenEvent) -> dict:
    return {"id": e.token, "text": e.text, "logprob": e.logprob if e.logprob is not None else 0.0,
            "special": e.token in tokenizer.eos_ids}


def _details(req: Sequence, f: Finished) -> dict:
    # cached_tokens (an extension): prompt tokens whose KV was reused rather than prefilled
    return {"finish_reason": TGI_REASONS[f.reason], "generated_tokens": f.completion_tokens, "seed": req.params.seed,
            "cached_tokens": f.cached_tokens}


@router.post("/generate")
async def generate(body: GenerateRequest, http: HttpRequest) -> dict:
    req = await _start(http, body)
    tokens, finished = await generation.collect(http, req)
    text = (body.inputs if body.parameters.return_full_text else "") + finished.output
    out: dict = {"generated_text": text}
    if body.parameters.details:
        tok = generation.engine_of(http).tokenizer
        out["details"] = {**_details(req, finished), "prefill": [], "tokens": [_token(tok, e) for e in tokens]}
    return out


@router.post("/generate_stream")
async def generate_stream(body: GenerateRequest, http: HttpRequest) -> StreamingResponse:
    req = await _start(http, body)
    tok = generation.engine_of(http).tokenizer

    async def stream():
        index = 0
        async for event in generation.events(http, req, watch_disconnect=False):
            if isinstance(event, TokenEvent):
                index += 1
                yield generation.sse({"index": index, "token": _token(tok, event), "generated_text": None, "details": None})
                continue
            if event.error is not None:
                yield generation.sse_error(event.error)
                return
            # the end carries the token that ended it; one without (e.g. cancelled) ends with an empty special token
            index += event.last is not None
            last = event.last or TokenEvent(token=-1)
            final = {**_token(tok, TokenEvent(last.token, last.text + event.text, last.logprob)), "special": event.last is None}
            text = (body.inputs if body.parameters.return_full_text else "") + event.output
            yield generation.sse({"index": index, "token": final, "generated_text": text, "details": _details(req, event)})

    return StreamingResponse(stream(), media_type="text/event-stream", headers=generation.SSE_HEADERS)


@router.post("/", include_in_schema=False)
async def tgi_root(body: GenerateRequest, http: HttpRequest):
    return await (generate_stream(body, http) if body.stream else generate(body, http))

"""The `kvserve` command: fetch, export, generate, serve."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time
from pathlib import Path

import uvicorn

from kvcache import Sizing

from . import cluster
from .config import KV_DTYPES, POOLINGS, EngineConfig, ServerConfig, parse_bytes
from .engine.drafts import MODES, SpeculationConfig
from .listener import origin_list, uvicorn_config
from .local import exit_now

log = logging.getLogger("kvserve")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    from models.catalog import DEFAULT_MODEL, DEFAULT_WEIGHTS
    from models.quant import ACTIVATIONS, WEIGHT_MODES

    p.add_argument("--model", default=DEFAULT_MODEL, help="named model, .gguf file, HF folder or exported artifact folder")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="activation dtype")
    p.add_argument("--weights", default=DEFAULT_WEIGHTS, choices=["auto", *WEIGHT_MODES],
                   help="auto: every weight as its file stores it (GGUF's block formats, F16, BF16, F32), each with its own "
                        "AVX2 kernel; where the kernels cannot build, f16. Requantizing only when asked: f32 (the exact "
                        "reference), f16, q4 (Q4_1), q4_0, q8_0")
    p.add_argument("--activations", default=ACTIVATIONS[0], choices=ACTIVATIONS,
                   help="how block-format products quantize their activations: int8, llama.cpp's precision (its "
                        "perplexity); int16 keeps greedy tokens the float model's, and runs batched and prefill steps "
                        "slower. f32 and f16 weights multiply in float either way")
    p.add_argument("--trust-artifact", action="store_true",
                   help="run an artifact folder's program.py although kvserve did not export it here (it is code)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="run the exported program as Python, never its AOTInductor-compiled package (which computes "
                        "the same tokens with less overhead a step; serve compiles it in the background once)")


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    p.add_argument("--session-capacity", type=int, default=d.session_capacity, help="default tokens per session")
    p.add_argument("--max-model-len", type=int, default=None, help="tokens a sequence may reach (default: the model's context)")
    p.add_argument("--session-sizing", choices=[s.value for s in Sizing], default=d.session_sizing.value)
    p.add_argument("--kv-budget", type=parse_bytes, default=d.kv_budget, help="bytes for all KV caches, e.g. 2GiB")
    p.add_argument("--max-batch-tokens", type=int, default=d.max_batch_tokens,
                   help="tokens per step (chunked prefill); default 128, 256 for a mixture-of-experts model")
    p.add_argument("--mixed-prefill-tokens", type=int, default=d.mixed_prefill_tokens,
                   help="prefill tokens a step adds while others decode")
    p.add_argument("--max-running", type=int, default=d.max_running, help="sessions per step")
    p.add_argument("--max-queued", type=int, default=d.max_queued, help="waiting requests before 429")
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default=d.kv_dtype,
                   help="KV cache element type; auto: float16 with f16/q4 weights (half the memory and reads), else the model's dtype")
    p.add_argument("--kv-disk", default=None, metavar="DIR",
                   help="a disk tier under the KV pool: blocks by content and session records, kept across restarts")
    p.add_argument("--kv-disk-budget", type=parse_bytes, default=d.kv_disk_budget, help="bytes of KV blocks on disk")
    p.add_argument("--default-max-tokens", type=int, default=None,
                   help="cap on the reply of a request that names no max_tokens (default: what fits in its session)")
    p.add_argument("--max-sessions", type=int, default=d.max_sessions, help="persistent sessions the server holds in RAM")
    p.add_argument("--session-ttl", type=float, default=d.session_ttl,
                   help="seconds an idle session stays in RAM; then it moves to --kv-disk, or is removed")
    p.add_argument("--session-disk-ttl", type=float, default=d.session_disk_ttl,
                   help="seconds a session moved to --kv-disk stays there, unused, before it is deleted")
    p.add_argument("--request-timeout", type=float, default=None,
                   help="seconds a request may take from arrival; queued past it: 408, running: it ends (finish reason timeout)")
    p.add_argument("--constraint-timeout", type=float, default=d.constraint_timeout,
                   help="seconds a grammar, regex, schema or tool list may take to compile; past it: 400")
    p.add_argument("--mask-timeout", type=float, default=d.mask_timeout,
                   help="seconds one token's grammar mask may take; past it the reply ends (finish reason unmet)")
    p.add_argument("--max-sessions-per-key", type=int, default=None,
                   help=f"sessions one tenant may hold (default with keys or --tenant-header: 1/{SESSION_SHARE} of --max-sessions)")
    p.add_argument("--max-running-per-key", type=int, default=None,
                   help=f"requests one tenant may have running (default with keys or --tenant-header: 1/{SLOT_SHARE} of --max-running)")
    p.add_argument("--max-queued-per-key", type=int, default=None,
                   help=f"requests one tenant may have queued (default with keys or --tenant-header: 1/{SLOT_SHARE} of --max-queued)")
    p.add_argument("--speculative", choices=MODES, default=SpeculationConfig().mode,
                   help="ngram: decoding requests draft tokens from their own history, checked in one step (a request's "
                        "`speculative` overrides it); off: one token a step")
    p.add_argument("--num-speculative-tokens", type=int, default=SpeculationConfig().max_draft, help="draft tokens per step, at most")
    p.add_argument("--kv-events", default=None, metavar="tcp://HOST:PORT",
                   help="publish KV events (blocks stored and removed, vLLM's format) there for vllm-router's kv_aware policy")
    p.add_argument("--kv-events-replay", default=None, metavar="tcp://HOST:PORT", help="where a router asks for batches it missed")
    p.add_argument("--shared-prefix-cache", action="store_true",
                   help="tenants share cached prefixes (a common system prompt); else each tenant's are its own, so "
                        "none can learn from cached_tokens or timing what another sent")
    p.add_argument("--pooling", choices=POOLINGS, default=d.pooling,
                   help="embeddings (/v1/embeddings, /api/embed): the mean of the prompt's final normed hidden states, "
                        "or the last token's; L2-normalized either way")
    p.add_argument("--tenant-weights", default="", metavar="NAME=W,...",
                   help="shares of served tokens: NAME is an API key or a --tenant-header value; others weigh 1")
    p.add_argument("--peers", action="append", metavar="URL,...",
                   help="the servers sharing --kv-disk, this one too: a request for a session one of them holds is sent "
                        "there, and sessions on disk at start wait for a request (kvserve cluster passes it)")


SESSION_SHARE, SLOT_SHARE = 4, 2  # a tenant's default share of the server's sessions, and of its slots


def _engine_config(args) -> EngineConfig:
    keys = tuple(getattr(args, "api_key", None) or ())
    tenants = bool(keys or getattr(args, "tenant_header", None))  # else every client is the one tenant

    def share(own, total, parts):
        return own if own is not None or not tenants else max(1, total // parts)

    return EngineConfig(
        max_sessions=args.max_sessions,
        max_sessions_per_key=share(args.max_sessions_per_key, args.max_sessions, SESSION_SHARE),
        max_running_per_key=share(args.max_running_per_key, args.max_running, SLOT_SHARE),
        max_queued_per_key=share(args.max_queued_per_key, args.max_queued, SLOT_SHARE),
        tenant_weights=_tenant_weights(args.tenant_weights, keys),
        session_ttl=args.session_ttl,
        session_disk_ttl=args.session_disk_ttl,
        request_timeout=args.request_timeout,
        constraint_timeout=args.constraint_timeout,
        mask_timeout=args.mask_timeout,
        session_capacity=args.session_capacity,
        max_model_len=args.max_model_len,
        session_sizing=Sizing(args.session_sizing),
        kv_budget=args.kv_budget,
        max_batch_tokens=args.max_batch_tokens,
        mixed_prefill_tokens=args.mixed_prefill_tokens,
        max_running=args.max_running,
        max_queued=args.max_queued,
        kv_dtype=args.kv_dtype,
        default_max_tokens=args.default_max_tokens,
        kv_disk=args.kv_disk,
        kv_disk_budget=args.kv_disk_budget,
        speculation=SpeculationConfig(args.speculative, max_draft=args.num_speculative_tokens),
        kv_events=args.kv_events,
        kv_events_replay=args.kv_events_replay,
        shared_prefix_cache=args.shared_prefix_cache,
        pooling=args.pooling,
        peers=origin_list(args.peers or ()),
    )


def _tenant_weights(text: str, keys: tuple[str, ...]) -> tuple[tuple[str, float], ...]:
    """'k1=2,team-a=0.5' -> (owner id, weight) for each way a request may act as that name: as the API key
    itself, or as a tenant a gateway names under any of the keys (or from a trusted proxy)."""
    from .engine.session import owner_id, principal

    weights = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, eq, value = item.rpartition("=")
        try:
            weight = float(value)
        except ValueError:
            weight = 0.0
        if not eq or not name or weight <= 0:
            raise ValueError(f"--tenant-weights wants NAME=WEIGHT with a positive weight, got {item!r}")
        ids = {owner_id(name), *(owner_id(principal(key, name)) for key in (*keys, None))}
        weights += [(i, weight) for i in ids]
    return tuple(weights)


def cmd_fetch(args) -> int:
    from models.catalog import fetch

    print(fetch(args.model))
    return 0


def cmd_kernels(args) -> int:
    """Build (or find already built) the C++/AVX2 kernels, so no server start pays for compiling them."""
    from kvcache import REGISTRY
    from models.quant import model_kernels_available

    models_ok = model_kernels_available()
    attention_ok = REGISTRY.native_attention()
    print(f"model kernels (block formats, fused ops): {'ready' if models_ok else 'unavailable'}; "
          f"span attention: {'ready' if attention_ok else 'unavailable'}")
    return 0 if models_ok and attention_ok else 1


def cmd_export(args) -> int:
    from models.artifact_save import save_artifact
    from models.export import activations_for
    from models.loader import DTYPES, export_checkpoint, resolve, resolve_weights

    start = time.time()
    weights = resolve_weights(args.weights)
    activations = activations_for(weights, args.activations)
    program, config, tokenizer, held = export_checkpoint(resolve(args.model), DTYPES[args.dtype], progress=True, weights=weights,
                                                         activations=activations)
    save_artifact(Path(args.out), program, config, tokenizer, DTYPES[args.dtype], name=args.model, weights=weights,
                  held=held[0], held_bytes=held[1], activations=activations)
    print(f"exported {args.model} to {args.out} in {time.time() - start:.1f}s", file=sys.stderr)
    return 0


def cmd_generate(args) -> int:
    from models.loader import load_model

    from .engine.engine import Engine
    from .engine.model_thread import model_thread
    from .api.generation import output_stream
    from .engine.sampling import SamplingParams
    from .engine.sequence import Finished

    worker = model_thread()
    model = worker.submit(load_model, args.model, args.dtype, progress=True, weights=args.weights,
                          trust_artifact=args.trust_artifact, activations=args.activations).result()
    tok = model.tokenizer
    chat = not args.raw and tok.meta.chat_template is not None
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": args.prompt}]), add_special=False) if chat else tok.encode(args.prompt)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            seed=args.seed, stop=tuple(args.stop))

    async def run() -> int:
        engine = Engine(model, _engine_config(args), worker=worker)
        engine.start()
        session = engine.create_session(None, None, None, persistent=False)
        req = engine.submit(session, prompt, params, resend=False)
        output = output_stream(engine, req)
        try:
            while not isinstance(event := output.render(await req.events.get()), Finished):
                sys.stdout.write(event.text if event is not None else "")
                sys.stdout.flush()
            sys.stdout.write((event.last.text if event.last is not None else "") + event.text)
            sys.stdout.write("\n")
            sys.stdout.flush()
            return 0 if event.error is None else 1
        except BrokenPipeError:
            # the reader left (`| head -c 20`): end quietly, with the status of a tool that SIGPIPE ended,
            # and let nothing flush into the closed pipe again at exit
            engine.cancel(req)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 128 + signal.SIGPIPE
        finally:
            await engine.stop()  # else the model thread waits for work while the interpreter joins it

    return asyncio.run(run())


def cmd_serve(args) -> int:
    from models.compiled_program import compile_in_background
    from models.loader import load_model

    from .access_log import quiet_health_checks
    from .api.app import create_app
    from .api.model_names import parse_names
    from .engine.engine import Engine
    from .engine.model_thread import model_thread

    start = time.time()
    worker = model_thread()  # loads the model too, so this thread never starts torch threads of its own
    model = worker.submit(load_model, args.model, args.dtype, progress=True, weights=args.weights,
                          trust_artifact=args.trust_artifact, compiled=not args.enforce_eager,
                          activations=args.activations, write_behind=True).result()
    names = parse_names(args.served_model_name or ())
    name = names[0] if names else (args.model if "/" not in args.model else Path(args.model.rstrip("/")).name)
    engine = Engine(model, _engine_config(args), worker=worker)
    server_config = ServerConfig(model_name=name, max_body_bytes=args.max_body_bytes, shutdown_timeout=args.shutdown_timeout,
                                 model_aliases=names[1:],
                                 header_timeout=args.header_timeout,
                                 tenant_header=args.tenant_header, trusted_proxies=tuple(args.trusted_proxy or ()),
                                 allowed_origins=origin_list(args.allowed_origins or ()), host=args.host,
                                 allowed_hosts=origin_list(args.allowed_hosts or ()), admin_key=args.admin_key)
    app = create_app(engine, server_config, frozenset(args.api_key or ()))
    log.info("loaded model %s (%s, %d layers, context %d; weights %s: %s; %s activations) in %.1fs", name,
             model.config.architecture, model.config.n_layers, model.config.max_context, model.weights, model.held_text(),
             model.activations, time.time() - start)
    if not args.enforce_eager and model.folder is not None and not model.forward.compiled:
        compile_in_background(model.forward, model.folder, model.saving)
    server = DrainingServer(uvicorn_config(app, args.host, args.port, header_timeout=server_config.header_timeout,
                                           log_level=args.log_level, timeout_graceful_shutdown=5),
                            engine, args.shutdown_timeout)
    quiet_health_checks()  # after uvicorn.Config, which (re)configures the uvicorn loggers
    server.run()
    if model.saving is not None:
        model.saving.stop()  # an artifact still being written is abandoned, its partial files removed
    exit_now(0 if server.started else 1)  # the app's lifespan has stopped the engine and closed its disk tier


class DrainingServer(uvicorn.Server):
    """uvicorn, except that SIGTERM first drains: new work gets 503 while in-flight requests finish."""

    def __init__(self, config: uvicorn.Config, engine, timeout: float) -> None:
        super().__init__(config)
        self.engine, self.timeout, self.draining = engine, timeout, False

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)  # exits if the port cannot be bound
        log.info("listening on http://%s:%d", self.config.host, self.config.port)

    def handle_exit(self, sig, frame) -> None:
        if sig == signal.SIGTERM and not self.draining:
            self.draining = True
            log.info("SIGTERM: draining for up to %.0fs", self.timeout)
            asyncio.get_event_loop().call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))
            return
        super().handle_exit(sig, frame)

    async def _drain(self) -> None:
        finished = await self.engine.drain(self.timeout)
        log.info("drained (%s); exiting", "all finished" if finished else "timed out")
        self.should_exit = True


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description="CPU-first multi-session LLM server")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("fetch", help="download a named model into the cache folder")
    _add_model_args(p)
    p.set_defaults(func=cmd_fetch)

    p = sub.add_parser("kernels", help="build the C++/AVX2 kernels now (they are cached by source hash)")
    p.set_defaults(func=cmd_kernels)

    p = sub.add_parser("export", help="export a model once into an artifact folder")
    _add_model_args(p)
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("generate", help="generate from a prompt, streaming to stdout")
    _add_model_args(p)
    _add_engine_args(p)
    p.add_argument("prompt")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[])
    p.add_argument("--raw", action="store_true", help="do not wrap the prompt in the chat template")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("serve", help="serve the HTTP API")
    _add_model_args(p)
    _add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", action="append", metavar="NAME,...",
                   help="the model's name in the API (default: --model's); more names, comma-separated or repeated, "
                        "are aliases clients may call it by")
    p.add_argument("--api-key", action="append", help="require this Bearer key (repeat for several keys); each key is a tenant")
    p.add_argument("--tenant-header", default=None, metavar="NAME",
                   help="a gateway's header naming the tenant (honoured under an API key, or from a --trusted-proxy)")
    p.add_argument("--trusted-proxy", action="append", metavar="IP", help="a gateway address whose --tenant-header is honoured without a key")
    p.add_argument("--allowed-origins", action="append", metavar="ORIGIN,...",
                   help="browser origins allowed to call the API (CORS), comma-separated or repeated; '*' for any (default: none)")
    p.add_argument("--allowed-hosts", action="append", metavar="HOST,...",
                   help="Host names answered besides localhost, 127.0.0.1 and [::1] when bound to loopback (a guard "
                        "against DNS rebinding), or the only ones answered elsewhere; '*' for any")
    p.add_argument("--admin-key", default=None,
                   help="the operator's key: under --api-key, /metrics and /get_load (every tenant's figures) need it")
    p.add_argument("--max-body-bytes", type=parse_bytes, default=ServerConfig().max_body_bytes)
    p.add_argument("--shutdown-timeout", type=float, default=ServerConfig().shutdown_timeout)
    p.add_argument("--header-timeout", type=float, default=ServerConfig().header_timeout,
                   help="seconds a request's line and headers may take to arrive before the connection is closed")
    p.add_argument("--log-level", default="info")
    p.set_defaults(func=cmd_serve)

    cluster.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError) as e:
        log.error("%s", e)
        return 2


if __name__ == "__main__":
    sys.exit(main())

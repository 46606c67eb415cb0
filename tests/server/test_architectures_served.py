"""Every architecture through the server's state: the prefix cache, a session's turns, and the disk tier
across a restart. Tiny random checkpoints that transformers writes (tests/models), served in-process at
f32 with an f32 KV, so a reply read from cached blocks must equal one computed afresh, token for token,
sliding windows and soft caps included. Each fresh reply is a new tenant's first request: prefixes are
salted by tenant, so it finds no block another request left."""

import httpx
import pytest

from kvcache.session_cache import PASSED, REWIND_MARGIN
from models import load_model
from server.config import EngineConfig

from ..live_server import LiveServer
from ..models.test_architectures import CHECKPOINTS, write_arch_checkpoint
from ..models.test_gemma import write_checkpoint
from ..models.test_moe import write_moe_checkpoint

GEMMAS = ("gemma2", "gemma3", "mistral-window")  # test_gemma's kinds; its mistral windows every layer
MOES = ("qwen3moe", "gpt-oss")  # test_moe's, gpt-oss windowed on every other layer
ARCHITECTURES = CHECKPOINTS + GEMMAS + MOES
# longer than every window (5 and 8) and its margin (kvcache/session_cache.py), so cached blocks hold keys
# every window has passed, and a session of a model windowed on every layer gives some back
PROMPT = ("Once upon a time, in a quiet village by the river, there lived a small fox who counted the stars every "
          "night. One evening the fox met an old owl, and they talked until the sun came up. The owl told of the "
          "mountains in the north, where snow never melts, and of a lake so clear that fish seemed to fly. The fox "
          "told of the meadow, the baker's bread, the miller's cat, and the bridge where children threw pebbles. "
          "When morning came, they promised to meet again at the old oak by the mill.")
QUESTIONS = [PROMPT + " What did the fox count?", "Who did it meet?", "When did they stop talking?"]
OWNER = "owner-secret"
FRESH = tuple(f"fresh-{i}-secret" for i in range(4))  # one a fresh reply: two servers, two turns each at most


@pytest.fixture(scope="module")
def folders(tmp_path_factory, smollm):
    root = tmp_path_factory.mktemp("served")
    out = {arch: (lambda a=arch, i=i: write_arch_checkpoint(root / a, a, smollm.tokenizer, seed=60 + i,
                                                                  longrope_context=512))
           for i, arch in enumerate(CHECKPOINTS)}
    for i, kind in enumerate(GEMMAS):
        out[kind] = lambda k=kind, i=i: write_checkpoint(root / k, k.removesuffix("-window"), smollm.tokenizer, seed=70 + i)
    for i, kind in enumerate(MOES):
        out[kind] = lambda k=kind, i=i: write_moe_checkpoint(root / k, k, smollm.tokenizer, seed=80 + i)
    return out


def bearer(key: str) -> dict:
    return {"authorization": f"Bearer {key}"}


def complete(url: str, prompt: str) -> dict:
    r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 0,
                                                   "ignore_eos": True}, headers=bearer(OWNER), timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def chat(url: str, messages: list[dict], key: str, session: str | None = None) -> dict:
    body = {"messages": messages, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    if session is not None:
        body["session_id"] = session
    r = httpx.post(url + "/v1/chat/completions", json=body, headers=bearer(key), timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def turn(url: str, session: str, history: list[dict], question: str, fresh_key: str) -> tuple[dict, dict]:
    """A session's turn, and the same conversation sent afresh by a new tenant -> (session's, fresh)."""
    history.append({"role": "user", "content": question})
    got = chat(url, history, OWNER, session)
    fresh = chat(url, history, fresh_key)
    history.append({"role": "assistant", "content": got["choices"][0]["message"]["content"]})
    return got, fresh


def text(reply: dict) -> str:
    choice = reply["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_prefix_cache_sessions_and_disk_tier_serve_each_architecture(folders, arch, tmp_path):
    model = load_model(str(folders[arch]()), weights="f32", use_cache=False)
    config = EngineConfig(kv_dtype="float32", kv_disk=str(tmp_path / "kv"))
    keys, fresh_keys = (OWNER, *FRESH), iter(FRESH)
    with LiveServer(model, config, api_keys=keys) as s:
        block = s.engine.pool.blocks.block_size
        first, again = complete(s.url, PROMPT), complete(s.url, PROMPT)
        n = first["usage"]["prompt_tokens"]
        assert n > 2 * block
        cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert (n - 1) // block * block <= cached < n, (cached, n)  # every full block but the last token's
        assert text(again) == text(first)  # attended through cached blocks: the same greedy tokens

        sid, history = httpx.post(s.url + "/v1/sessions", json={}, headers=bearer(OWNER)).json()["id"], []
        for question in QUESTIONS[:2]:
            got, fresh = turn(s.url, sid, history, question, next(fresh_keys))
            assert text(got) == text(fresh), (question, text(got), text(fresh))
        held = got["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert held >= got["usage"]["prompt_tokens"] - block - 8, got["usage"]  # the first turn's history, kept
        length = httpx.get(f"{s.url}/v1/sessions/{sid}", headers=bearer(OWNER)).json()["length"]
        windows = model.config.layer_windows
        if windows and min(windows) > 0:  # the blocks every window passed went back to the pool
            table = s.engine.sessions.get(sid, OWNER).cache.table
            assert table.count(PASSED) >= (length - max(windows) - REWIND_MARGIN) // block - 1 > 0, (length, table)

    with LiveServer(model, config, api_keys=keys) as s:  # a new engine on the same folder: the session comes back from disk
        got, fresh = turn(s.url, sid, history, QUESTIONS[2], next(fresh_keys))
        assert text(got) == text(fresh), (text(got), text(fresh))
        cached = got["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert length - block <= cached <= length, (cached, length)  # a new pool: every block read from disk

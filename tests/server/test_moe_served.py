"""Mixture-of-experts models served from llama.cpp's Q8_0 conversion of a tiny checkpoint, experts held as
stored: drafts change no greedy token, alone or beside other streams, and a row's tokens and logprobs never
depend on what shares its step (speculation relies on it). The prefix cache, sessions and the disk tier on
each MoE architecture: tests/server/test_architectures_served.py."""
import pytest

from models import load_model
from models.quant import model_kernels_available
from server.config import MOE_STEP_TOKENS, EngineConfig
from server.engine.drafts import SpeculationConfig

from ..live_server import LiveServer, metric
from ..models.test_architectures import write_gguf_from_hf
from ..models.test_moe import write_moe_checkpoint
from .test_speculation import COPY, post_all, reply

pytestmark = pytest.mark.skipif(not model_kernels_available(), reason="the C++/AVX2 kernels are unavailable")
WIDE = EngineConfig(speculation=SpeculationConfig(max_rows=128))  # drafts even beside many streams
DRAFTED = "kvserve:spec_decode_num_draft_tokens_total"


@pytest.fixture(scope="module", params=["qwen3moe", "gpt-oss"])
def moe_server(request, tmp_path_factory, smollm):
    root = tmp_path_factory.mktemp(f"served-{request.param}")
    folder = write_moe_checkpoint(root / "hf", request.param, smollm.tokenizer, seed=90)
    path = write_gguf_from_hf(folder, root / "model.q8_0.gguf", outtype="q8_0")
    model = load_model(str(path), weights="auto", use_cache=False)
    assert dict(model.held).get("Q8_0", 0) >= 3 * model.config.n_layers  # the experts too, as stored
    with LiveServer(model, WIDE) as server:
        assert server.engine.config.max_batch_tokens == MOE_STEP_TOKENS  # prefill chunks shared out over experts
        yield server


def chat(prompt: str, speculative: bool) -> dict:
    return {"messages": [{"role": "user", "content": prompt}], "max_tokens": 32, "temperature": 0, "ignore_eos": True,
            "logprobs": True, "top_logprobs": 2, "speculative": speculative}


def test_drafts_change_no_greedy_token_alone_or_beside_others(moe_server):
    url = moe_server.url
    drafted = metric(url, DRAFTED)
    off = [post_all(url, "/v1/chat/completions", [chat(p, False)])[0] for p in COPY]
    on = [post_all(url, "/v1/chat/completions", [chat(p, True)])[0] for p in COPY]
    assert [reply(r) for r in on] == [reply(r) for r in off]
    assert metric(url, DRAFTED) > drafted  # drafts were checked
    together = post_all(url, "/v1/chat/completions", [chat(COPY[i % 3], i % 2 == 0) for i in range(8)])
    for i, res in enumerate(together):
        assert reply(res) == reply(off[i % 3]), f"stream {i}"

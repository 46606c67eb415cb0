"""The program compiled ahead of time (models/compiled_program.py): it computes the same bits as program.py,
in prefills and decodes; it still calls the attention op once a layer; it holds no weights of its
own; only a package on the trust list runs; and `kvserve serve` switches to it while serving."""
import shutil
import time
import zipfile

import httpx
import pytest
import torch

from models import load_model
from models.compiled_program import PACKAGE_FILE, compile_package, load_package, program_tensors
from models.export import fingerprint
from models.quant import model_kernels_available

from ..live_server import free_port, start_cli_server, wait_healthy
from .test_models import PROMPT, Session, greedy, run_prompt

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    """A copy of SmolLM2's artifact (as served: weights as stored), its package compiled into it."""
    if not model_kernels_available():
        pytest.skip("the native kernels do not build here")
    folder = tmp_path_factory.mktemp("compiled") / "artifact"
    shutil.copytree(load_model("smollm2-135m-instruct", weights="auto").folder, folder)
    (folder / PACKAGE_FILE).unlink(missing_ok=True)
    before = fingerprint(folder)
    eager = load_model(str(folder), compiled=False)
    compile_package(eager.forward.module, eager.config.max_context, folder)
    assert fingerprint(folder) == before  # the KV does not depend on which of the two runs
    return folder


def test_the_package_computes_the_same_bits(artifact):
    eager, compiled = load_model(str(artifact), compiled=False), load_model(str(artifact))
    assert not eager.forward.compiled and compiled.forward.compiled
    ids = eager.tokenizer.encode(PROMPT)
    for chunks in ([len(ids)], [5, len(ids) - 5]):  # one prefill, and a prefill in two steps
        outs = []
        for model in (eager, compiled):
            with Session(model.config) as session:
                outs.append(run_prompt(session.committing(model.forward), model.config, ids, chunks, all_logits=True))
        assert torch.equal(*outs)
    assert greedy(eager.forward, eager.config, ids, 16) == greedy(compiled.forward, compiled.config, ids, 16)
    with zipfile.ZipFile(artifact / PACKAGE_FILE) as z:
        names = z.namelist()
        assert sum(z.getinfo(n).file_size for n in names) < 16 * 2**20  # code: the weights are the program's own
        calls = "".join(z.read(n).decode(errors="ignore") for n in names if n.endswith(".json"))
    assert calls.count("kvcache::update_and_attend") >= eager.config.n_layers  # the op, once a layer


def test_an_untrusted_package_never_runs(artifact, tmp_path):
    folder = tmp_path / "copy"
    shutil.copytree(artifact, folder)
    data = bytearray((folder / PACKAGE_FILE).read_bytes())
    data[-1] ^= 0xFF  # no longer the package kvserve compiled: its hash is not on the list
    (folder / PACKAGE_FILE).write_bytes(bytes(data))
    model = load_model(str(folder))
    assert not model.forward.compiled and load_package(model.forward.module, folder) is None


def test_serve_switches_to_the_package_without_changing_a_token(tmp_path):
    if not model_kernels_available():
        pytest.skip("the native kernels do not build here")
    folder = tmp_path / "artifact"
    shutil.copytree(load_model("smollm2-135m-instruct", weights="auto").folder, folder)
    (folder / PACKAGE_FILE).unlink(missing_ok=True)
    port = free_port()
    proc = start_cli_server(["--model", str(folder)], port)
    url = f"http://127.0.0.1:{port}"
    body = {"prompt": "The capital of France is", "max_tokens": 24, "temperature": 0}
    replies = []
    try:
        wait_healthy(url, timeout=300, proc=proc)
        deadline = time.monotonic() + 300
        while not (folder / PACKAGE_FILE).is_file() and time.monotonic() < deadline:  # served meanwhile
            replies.append(httpx.post(url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"])
        assert (folder / PACKAGE_FILE).is_file()
        time.sleep(5)  # the switch follows the package's loading
        replies.append(httpx.post(url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"])
    finally:
        proc.terminate()
        out = proc.communicate(timeout=60)[0]
    assert "the compiled program serves from now on" in out, out[-3000:]
    assert len(set(replies)) == 1 and len(replies) >= 2, replies  # the same tokens before and after
    # the next start runs the package at once
    assert load_model(str(folder)).forward.compiled

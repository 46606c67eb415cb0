"""A tiny random Llama whose context is long enough for a stream that outlasts a kill or a drain: its random
weights rarely sample EOS, so a large max_tokens keeps it generating."""
import json
import signal
import subprocess
from pathlib import Path

import httpx

from ..conftest import write_tiny_checkpoint
from ..live_server import free_port, start_cli_server, wait_healthy

CONTEXT = 4096
NAME = "tiny"


def long_tiny_checkpoint(folder: Path, tokenizer_source) -> Path:
    path = write_tiny_checkpoint(folder, "llama", tokenizer_source, seed=1)
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = CONTEXT  # rope takes any length: only the cap changes
    (path / "config.json").write_text(json.dumps(config))
    return path


def serve(model: Path, store: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = start_cli_server(["--model", str(model), "--served-model-name", NAME, "--kv-disk", str(store), *extra], port)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, timeout=300, proc=proc)
    return proc, url


def stop(proc: subprocess.Popen, sig=signal.SIGKILL, timeout: float = 90) -> str:
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=timeout)
    return out


def settle_disk(url: str) -> None:
    """Wait until the write-behind has nothing pending (it gets records to disk by itself)."""
    import time

    deadline = time.monotonic() + 60
    while httpx.get(url + "/v1/status").json()["disk"]["pending_writes"] and time.monotonic() < deadline:
        time.sleep(0.02)

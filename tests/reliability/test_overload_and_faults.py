import asyncio
import json
import random
import signal
import socket
import threading
import time

import httpx
import pytest

from kvcache import REGISTRY
from server.config import EngineConfig
from server.engine.kv_pool import kv_dtype

from ..live_server import LiveServer, free_port, metric, start_cli_server, wait_healthy


def gen_body(prompt, n, **params):
    return {"inputs": prompt, "parameters": {"max_new_tokens": n, "details": True, **params}}


def tokens_of(r):
    assert r.status_code == 200, r.text
    return [t["id"] for t in r.json()["details"]["tokens"]]


class HealthWatch:
    """Polls /health in a thread and records the slowest answer."""

    def __init__(self, url):
        self.url, self.worst, self.failures, self._stop = url, 0.0, [], threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        with httpx.Client(timeout=5) as c:
            while not self._stop.is_set():
                t = time.perf_counter()
                try:
                    if c.get(self.url + "/health").status_code != 200:
                        self.failures.append("status")
                except httpx.HTTPError as e:
                    self.failures.append(repr(e))
                self.worst = max(self.worst, time.perf_counter() - t)
                time.sleep(0.05)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self.thread.join()


def test_overload_gets_429_never_5xx_and_health_stays_fast(served_model):
    config = EngineConfig(max_running=4, max_queued=8)
    with LiveServer(served_model, config) as server, HealthWatch(server.url) as health:
        async def one(ac, i):
            r = await ac.post(server.url + "/generate", json=gen_body(f"Request number {i} says", 4))
            return r.status_code, r.headers.get("retry-after")

        async def run():
            limits = httpx.Limits(max_connections=250)
            async with httpx.AsyncClient(timeout=120, limits=limits) as ac:
                return await asyncio.wait_for(asyncio.gather(*(one(ac, i) for i in range(120))), 300)

        results = asyncio.run(run())
    codes = [c for c, _ in results]
    assert set(codes) <= {200, 429}, sorted(set(codes))
    # at least the running slots' and the queue's worth succeed (all 120 may arrive before a step admits one)
    assert codes.count(200) >= 12 and codes.count(429) > 0
    assert all(ra is not None for c, ra in results if c == 429)
    # issue 24's bound: /health under 1 s. The 120-request client, the server and this watcher share one
    # process (one GIL) on 2 cores, so it is loose; a loop blocked behind a model step or a prefill breaks it
    assert not health.failures and health.worst < 1.0, (health.worst, health.failures[:3])


def test_disconnect_storm_frees_everything(served_model):
    config = EngineConfig(max_running=32, max_queued=400)
    with LiveServer(served_model, config) as server:
        keep = httpx.post(server.url + "/v1/sessions", json={}).json()["id"]
        httpx.post(server.url + "/generate", json={**gen_body("Keep me", 2), "session_id": keep})
        baseline = metric(server.url, "kvserve:kv_cache_usage_bytes")
        rng = random.Random(7)

        async def aborted(ac, i):
            stop_after = rng.randint(0, 4)
            try:
                async with ac.stream("POST", server.url + "/generate_stream", json=gen_body(f"Story {i}:", 50)) as r:
                    seen = 0
                    async for line in r.aiter_lines():
                        if line.startswith("data:"):
                            seen += 1
                            if seen >= stop_after:
                                break
            except httpx.HTTPError:
                pass

        async def run():
            async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=400)) as ac:
                await asyncio.gather(*(aborted(ac, i) for i in range(300)))

        asyncio.run(run())
        engine = server.engine
        deadline = time.time() + 30
        while time.time() < deadline and (engine.scheduler.has_work() or any(not s.persistent for s in engine.sessions)):
            time.sleep(0.1)
        assert not engine.scheduler.has_work()
        assert set(REGISTRY.keys()) & {s.id for s in engine.sessions} == {keep}
        assert [s.id for s in engine.sessions] == [keep]
        deadline = time.time() + 10  # the gauges are set by the step loop's next pass
        while time.time() < deadline and metric(server.url, "kvserve:kv_cache_usage_bytes") != baseline:
            time.sleep(0.05)
        assert metric(server.url, "kvserve:kv_cache_usage_bytes") == baseline
        assert metric(server.url, "kvserve:num_requests_running") == 0


def test_capacity_ends_with_length_while_others_stream(smollm):
    # exact weights: `other` runs batched beside `capped` and is compared with its run alone
    with LiveServer(smollm) as server:
        url = server.url
        small = httpx.post(url + "/v1/sessions", json={"capacity": 40, "sizing": "static"}).json()["id"]
        solo = tokens_of(httpx.post(url + "/generate", json=gen_body("The history of Rome", 30), timeout=120))

        async def run():
            async with httpx.AsyncClient(timeout=120) as ac:
                # max_new_tokens is left to the session: generation stops at its capacity
                capped = ac.post(url + "/v1/completions", json={"prompt": "Tell me about the ocean and its", "ignore_eos": True},
                                 headers={"X-Session-Id": small})
                other = ac.post(url + "/generate", json=gen_body("The history of Rome", 30))
                return await asyncio.gather(capped, other)

        capped, other = asyncio.run(run())
        assert capped.status_code == 200
        assert capped.json()["choices"][0]["finish_reason"] == "length"
        assert httpx.get(f"{url}/v1/sessions/{small}").json()["length"] == 40
        assert tokens_of(other) == solo
        # a full session can take no more
        r = httpx.post(url + "/generate", json={**gen_body("more", 1), "session_id": small})
        assert r.status_code == 400 and "capacity of 40" in r.json()["error"]["message"]
        # a request without a session may use the model's whole context, and no more
        r = httpx.post(url + "/v1/completions", json={"prompt": "hello " * 30, "max_tokens": 9000})
        assert r.status_code == 400
        msg = r.json()["error"]["message"]
        assert "31 tokens" in msg and "9000" in msg and "8192" in msg
        r = httpx.post(url + "/v1/sessions", json={"capacity": 10**6})
        assert r.status_code == 400 and "8192" in r.json()["error"]["message"]


def test_eviction_keeps_outputs_identical(smollm):
    # exact weights: an evicted history is recomputed in other shapes than it was first run in, and q4's
    # kernels change float order with the rows in a step, so on q4 equal tokens would be luck
    served_model = smollm
    capacity = 128
    per_token = 30 * 3 * 64 * 2 * kv_dtype("auto", served_model).itemsize  # layers x KV heads x head dim x (K, V)
    tight = EngineConfig(kv_budget=2 * capacity * per_token, session_capacity=capacity, session_sizing="static")

    def conversation(server):
        url = server.url
        sids = [httpx.post(url + "/v1/sessions", json={}).json()["id"] for _ in range(6)]
        outs = {i: [] for i in range(6)}
        for turn in range(3):
            for i, sid in enumerate(sids):
                r = httpx.post(url + "/generate", json={**gen_body(f" Turn {turn} of session {i}:", 5), "session_id": sid}, timeout=120)
                outs[i].append(tokens_of(r))
        return outs, server.engine.metrics

    with LiveServer(served_model, tight) as server:
        constrained, m = conversation(server)
        evictions = metric(server.url, "kvserve:num_session_evictions_total")
        assert metric(server.url, "kvserve:kv_cache_usage_bytes") <= tight.kv_budget
    with LiveServer(served_model, EngineConfig(session_capacity=capacity, session_sizing="static")) as server:
        free, _ = conversation(server)
    assert evictions >= 12
    assert constrained == free


class FailingRunner:
    """The engine's runner, wrapped by the test: a step holding a marked session fails after its forward.

    The server has no fault hook of its own; the drill substitutes its runner from outside."""

    def __init__(self, runner) -> None:
        self.runner, self.fail = runner, set()  # session ids, or "*" for the next step whatever it holds

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def run(self, batch):
        out = self.runner.run(batch)
        marked = {c.session_id for c in batch.chunks} & self.fail
        if marked or "*" in self.fail:
            self.fail.clear()
            raise RuntimeError(f"fault injected by the test into a step of {sorted(marked) or 'any session'}")
        return out


def test_failed_step_fails_only_its_requests(served_model):
    with LiveServer(served_model) as server:
        url, runner = server.url, FailingRunner(server.engine.runner)
        server.engine.runner = runner

        def session_with(prompt):
            sid = httpx.post(url + "/v1/sessions", json={}).json()["id"]
            tokens_of(httpx.post(url + "/generate", json={**gen_body(prompt, 4), "session_id": sid}, timeout=120))
            return sid

        a, b = session_with("Alpha says"), session_with("Beta says")
        a_ref, b_ref = session_with("Alpha says"), session_with("Beta says")
        length = httpx.get(f"{url}/v1/sessions/{a}").json()["length"]
        runner.fail.add(a)
        r = httpx.post(url + "/generate", json={**gen_body(" and then", 6), "session_id": a})
        assert r.status_code == 500 and "fault" in r.json()["error"]["message"]
        assert httpx.get(f"{url}/v1/sessions/{a}").json()["length"] == length
        for sid, ref in ((a, a_ref), (b, b_ref)):
            got = tokens_of(httpx.post(url + "/generate", json={**gen_body(" and then", 6), "session_id": sid}, timeout=120))
            want = tokens_of(httpx.post(url + "/generate", json={**gen_body(" and then", 6), "session_id": ref}, timeout=120))
            assert got == want
        assert httpx.get(url + "/health").status_code == 200
        runner.fail.add("*")
        plain = httpx.post(url + "/generate", json=gen_body("x", 2))
        assert plain.status_code == 500
        server.engine.pool.blocks.check()
        assert httpx.post(url + "/generate", json=gen_body("x", 2)).status_code == 200


@pytest.mark.slow
def test_sigterm_drains_streams_then_exits_zero(served_model):
    port = free_port()
    proc = start_cli_server(["--shutdown-timeout", "60"], port)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, timeout=300, proc=proc)
        results, started = {}, threading.Barrier(5)

        def stream(i):
            final = None
            with httpx.stream("POST", url + "/generate_stream", json=gen_body(f"Story {i}:", 40), timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        if final is None:
                            started.wait(timeout=60)  # every stream is admitted before the signal
                        final = json.loads(line[5:])
            results[i] = final

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        started.wait(timeout=60)
        proc.send_signal(signal.SIGTERM)
        def status(method, path, **kw):
            try:
                return httpx.request(method, url + path, timeout=10, **kw).status_code
            except httpx.ConnectError:
                return "refused"

        deadline = time.time() + 10  # the signal handler runs on the server's loop: wait until it has
        while time.time() < deadline and status("GET", "/health") == 200:
            time.sleep(0.02)
        assert status("POST", "/generate", json=gen_body("new", 2)) in (503, "refused")
        for t in threads:
            t.join(timeout=120)
        for i in range(4):
            assert results[i]["details"]["finish_reason"] == "length"
            assert results[i]["details"]["generated_tokens"] == 40
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_port_in_use_exits_with_an_error_and_never_says_listening(tiny_checkpoints):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        proc = start_cli_server(["--model", str(tiny_checkpoints["llama"])], held.getsockname()[1])
        out, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0
    assert "address already in use" in out.lower() and "listening" not in out, out[-2000:]

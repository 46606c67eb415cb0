"""Many clients at once on one server: turns, forks, rewinds, stop strings cut mid-stream, aborts, and
plain requests that share prefixes, on exact (f32) weights and a KV budget small enough to evict.

Each client keeps its own model of its session's tokens (what it sent, plus the ids it was really sent
back) and checks the server's length against it after every operation. Afterwards every reply is asked
again, alone and in order, of a second server: the tokens a turn continued from, with the same limits
and stop strings, must give the same text.
"""
from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest

from server.config import EngineConfig

from ..live_server import LiveServer, metric

MODEL = "smollm2-135m-instruct"
PREFIXES = [
    "The old lighthouse keeper wrote in his journal every night about the ships",
    "Recipe notes: to make a good bread you need flour, water, salt and",
    "In the year 2130 the colony on Mars finally received its first",
]
WORDS = "river stone cloud lamp garden violin harbor meadow pepper lantern orbit candle".split()
STOPS = [".", " the", ","]
MIN_OPS = 6  # operations each client makes even past the deadline


class Client:
    """One user: a session it owns (and its forks), and a model of each one's tokens."""

    def __init__(self, http: httpx.AsyncClient, url: str, tokenizer, seed: int, replies: list) -> None:
        self.http, self.url, self.tok, self.rng, self.replies = http, url, tokenizer, random.Random(seed), replies
        self.sid: str | None = None
        self.tokens: list[int] = []  # the session's history, as this client knows it

    async def run(self, deadline: float) -> None:
        ops = [self.turn, self.turn, self.stream_turn, self.fork, self.rewind, self.abort, self.plain]
        await self.new_session()
        done = 0
        while time.monotonic() < deadline or done < MIN_OPS:  # however slow the machine, every kind of step
            done += 1
            await (self.rewind() if len(self.tokens) > 160 else self.rng.choice(ops)())  # each fits the budget
            await self.check_length()
        await self.http.delete(f"{self.url}/v1/sessions/{self.sid}")

    def text(self) -> str:
        return " " + " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(1, 6)))

    async def new_session(self) -> None:
        r = await self.http.post(self.url + "/v1/sessions", json={})
        assert r.status_code == 200, r.text
        self.sid, self.tokens = r.json()["id"], []
        # a long opening: the clients' histories together outgrow the KV budget from their first turns
        await self.turn(self.rng.choice(PREFIXES) + "".join(self.text() for _ in range(20)))

    async def check_length(self) -> None:
        r = await self.http.get(f"{self.url}/v1/sessions/{self.sid}")
        assert r.status_code == 200 and r.json()["length"] == len(self.tokens), (r.text, len(self.tokens))

    def _params(self, stop: bool) -> dict:
        params = {"max_new_tokens": self.rng.randint(3, 8), "details": True}
        if stop:
            params["stop"] = self.rng.sample(STOPS, 2)
        return params

    def _record(self, text: str, params: dict, ids: list[int], got: str) -> None:
        prompt = self.tokens + self.tok.encode(text)
        self.replies.append((prompt, params["max_new_tokens"], params.get("stop", []), got))
        self.tokens = prompt + ids

    async def turn(self, text: str | None = None) -> None:
        text = text or self.text()
        params = self._params(stop=self.rng.random() < 0.3)
        r = await self.http.post(self.url + "/generate", json={"inputs": text, "session_id": self.sid, "parameters": params})
        assert r.status_code == 200, r.text
        body = r.json()
        self._record(text, params, [t["id"] for t in body["details"]["tokens"]], body["generated_text"])

    async def stream_turn(self) -> None:
        """A streamed turn with stop strings: the server cuts the request where the text stops."""
        text, params = self.text(), self._params(stop=True)
        ids, final = [], None
        body = {"inputs": text, "session_id": self.sid, "parameters": params}
        async with self.http.stream("POST", self.url + "/generate_stream", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    event = json.loads(line[5:])
                    if event["generated_text"] is None:
                        ids.append(event["token"]["id"])
                    else:
                        final = event
        assert final is not None
        ids += [final["token"]["id"]] if final["token"]["id"] != -1 else []
        assert len(ids) == final["details"]["generated_tokens"]
        self._record(text, params, ids, final["generated_text"])

    async def fork(self) -> None:
        """Fork, take a turn on the child, then keep one of the two and delete the other."""
        r = await self.http.post(f"{self.url}/v1/sessions/{self.sid}/fork")
        assert r.status_code == 200, r.text
        parent, parent_tokens = self.sid, list(self.tokens)
        self.sid = r.json()["id"]
        await self.turn()
        await self.check_length()
        if self.rng.random() < 0.5:  # back to the parent, which must not have seen the child's turn
            await self.http.delete(f"{self.url}/v1/sessions/{self.sid}")
            self.sid, self.tokens = parent, parent_tokens
        else:
            await self.http.delete(f"{self.url}/v1/sessions/{parent}")

    async def rewind(self) -> None:
        length = self.rng.randint(0, len(self.tokens))
        r = await self.http.post(f"{self.url}/v1/sessions/{self.sid}/rewind", json={"length": length})
        assert r.status_code == 200, r.text
        del self.tokens[length:]
        if not self.tokens:
            await self.turn(self.rng.choice(PREFIXES) + self.text())

    async def abort(self) -> None:
        """A streamed turn the client leaves after its first token; then it rewinds to what it knows."""
        body = {"inputs": self.text(), "session_id": self.sid, "parameters": {"max_new_tokens": 40}}
        async with self.http.stream("POST", self.url + "/generate_stream", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    break
        for _ in range(1200):  # the server notices the gone client at its next send
            r = await self.http.post(f"{self.url}/v1/sessions/{self.sid}/rewind", json={"length": len(self.tokens)})
            if r.status_code != 409:
                break
            await asyncio.sleep(0.025)
        assert r.status_code == 200, r.text

    async def plain(self) -> None:
        """A request without a session whose prompt shares a prefix with other clients' sessions."""
        prompt = self.rng.choice(PREFIXES) + self.text()
        n = self.rng.randint(3, 8)
        r = await self.http.post(self.url + "/v1/completions", json={
            "model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0})
        assert r.status_code == 200, r.text
        self.replies.append((prompt, n, [], r.json()["choices"][0]["text"]))


def drill(smollm, reference_server, seconds: float, clients: int) -> None:
    budget = 24 * reference_server.engine.pool.blocks.block_bytes  # 384 tokens: sessions get evicted
    replies: list = []
    with LiveServer(smollm, EngineConfig(kv_budget=budget)) as server:
        async def run():
            async with httpx.AsyncClient(timeout=120) as http:
                users = [Client(http, server.url, smollm.tokenizer, seed, replies) for seed in range(clients)]
                deadline = time.monotonic() + seconds
                await asyncio.gather(*(u.run(deadline) for u in users))

        asyncio.run(run())
        engine = server.engine
        for _ in range(200):
            if not engine.scheduler.has_work():
                break
            time.sleep(0.05)
        with engine.lock:
            blocks = engine.pool.blocks
            blocks.check()
            assert blocks.mismatches == 0
            assert sum(blocks.refs) == 0 and blocks.reserved == 0  # every session was deleted
        assert metric(server.url, "kvserve:prefix_cache_mismatches_total") == 0
        evicted = metric(server.url, "kvserve:num_session_evictions_total") + metric(server.url, "kvserve:num_preemptions_total")
        assert evicted > 0
    assert len(replies) >= 2 * clients
    print(f"{len(replies)} replies; {evicted:.0f} evictions and preemptions")
    for prompt, n, stop, got in replies:  # alone, one after another
        r = httpx.post(reference_server.url + "/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0, **({"stop": stop} if stop else {})})
        assert r.json()["choices"][0]["text"] == got, (prompt, n, stop)
    assert metric(reference_server.url, "kvserve:prefix_cache_mismatches_total") == 0


def test_concurrent_clients_get_the_replies_they_would_get_alone(smollm, smollm_server):
    drill(smollm, smollm_server, seconds=12, clients=6)


@pytest.mark.slow
def test_concurrent_clients_get_the_replies_they_would_get_alone_at_length(smollm, smollm_server):
    drill(smollm, smollm_server, seconds=45, clients=10)

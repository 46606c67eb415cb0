"""Locust load test for kvserve (or any TGI/OpenAI-compatible server).

    locust -f bench/locustfile.py --host http://127.0.0.1:8000 --headless -u 16 -r 4 -t 60s --csv results/locust

Three user classes: TGI streaming (/generate_stream), OpenAI streaming chat, and multi-turn session
users (create a session, run several turns, delete it). Time to first token and the gap between
tokens are reported as their own locust entries ("TTFT ..." and "ITL ...", in ms) beside the
request latencies.
"""
from __future__ import annotations

import json
import os
import random
import secrets
import time

from locust import HttpUser, between, task

MAX_TOKENS = int(os.environ.get("KVSERVE_LOCUST_MAX_TOKENS", "32"))
MODEL = os.environ.get("KVSERVE_LOCUST_MODEL", "smollm2-135m-instruct")
TOPICS = ["the sea", "a robot", "coffee", "the moon", "a small town", "trains", "winter", "music"]


class _Streaming(HttpUser):
    abstract = True
    wait_time = between(0.5, 2.0)

    def _record(self, kind: str, name: str, ms: float) -> None:
        self.environment.events.request.fire(request_type=kind, name=name, response_time=ms, response_length=0,
                                             exception=None, context={})

    def stream(self, name: str, path: str, body: dict, headers: dict | None = None) -> str:
        """POST an SSE request; record TTFT and inter-token latency; return the text streamed."""
        start = time.perf_counter()
        last, text = None, ""
        with self.client.post(path, json=body, headers=headers or {}, stream=True, name=name, catch_response=True) as r:
            if r.status_code != 200:
                r.failure(f"{r.status_code}: {r.text[:200]}")
                return ""
            for line in r.iter_lines():
                if not line or not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    break
                event = json.loads(payload)
                if "error" in event:
                    r.failure(event["error"])
                    return text
                piece = _text_of(event)
                if not piece:  # e.g. the opening role chunk of a chat stream: no token yet
                    continue
                now = time.perf_counter()
                if last is None:
                    self._record("TTFT", name, (now - start) * 1000)
                else:
                    self._record("ITL", name, (now - last) * 1000)
                last, text = now, text + piece
            r.success()
        return text


def _text_of(event: dict) -> str:
    if "token" in event:  # TGI
        return event["token"]["text"]
    choice = (event.get("choices") or [{}])[0]
    return choice.get("delta", {}).get("content") or choice.get("text") or ""


class TGIStreamUser(_Streaming):
    """Streams /generate_stream."""

    @task
    def generate(self) -> None:
        body = {"inputs": f"Write a short story about {random.choice(TOPICS)}.", "parameters": {"max_new_tokens": MAX_TOKENS}}
        self.stream("/generate_stream", "/generate_stream", body)


class OpenAIChatUser(_Streaming):
    """Streams /v1/chat/completions."""

    @task
    def chat(self) -> None:
        body = {"model": MODEL, "stream": True, "max_tokens": MAX_TOKENS,
                "messages": [{"role": "user", "content": f"Tell me something about {random.choice(TOPICS)}."}]}
        self.stream("/v1/chat/completions", "/v1/chat/completions", body)


class SessionUser(_Streaming):
    """Creates a session, runs several chat turns in it, deletes it."""

    @task
    def conversation(self) -> None:
        sid = secrets.token_urlsafe(24)  # our own id, so a hashing load balancer can route on it
        headers = {"X-Session-Id": sid}
        with self.client.post("/v1/sessions", json={}, headers=headers, name="/v1/sessions", catch_response=True) as r:
            if r.status_code != 200:
                r.failure(f"{r.status_code}: {r.text[:200]}")
                return
        messages = []
        for turn in range(random.randint(2, 4)):
            messages.append({"role": "user", "content": f"Turn {turn}: say something about {random.choice(TOPICS)}."})
            body = {"model": MODEL, "stream": True, "max_tokens": MAX_TOKENS, "messages": messages}
            reply = self.stream("/v1/chat/completions [session]", "/v1/chat/completions", body, headers)
            messages.append({"role": "assistant", "content": reply})
        self.client.delete(f"/v1/sessions/{sid}", name="/v1/sessions/{id}")

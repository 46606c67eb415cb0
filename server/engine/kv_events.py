"""KV events for a router: what the prefix index gained and lost, published over ZMQ as vLLM's KV event
publisher does, in the form vllm-router's kv_aware policy reads (docs/scaling.md).

A message is three frames, [topic (empty), sequence number (8 bytes, big-endian, from 0), payload]; the
payload is msgpack [timestamp, events, data-parallel rank 0], and each event a map tagged by "type":
BlockStored (the block hashes, the parent's, the blocks' token ids, the block size, the medium),
BlockRemoved and AllBlocksCleared. The medium is "CPU" for the pool's blocks and "DISK" for the blocks
this server wrote to the disk tier (--kv-disk), which the router credits less (--kv-penalty-disk). The
hashes are the pool's own chained digests, as msgpack bin: the router keys its index on the token ids the
events carry and chains blocks by these hashes, so it needs no hash function of kvserve's. The first
batch clears whatever a router knew of this endpoint (a restarted server starts empty); a router that
missed a batch asks the replay socket for it.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque

log = logging.getLogger("kvserve.kv_events")

# The pool's blocks are in RAM, the memory kvserve computes from: vllm-router's host tier (kvserve
# cluster credits it in full). The disk tier's must be read back before use: the router's disk tier.
RAM, DISK = "CPU", "DISK"
REPLAY_BATCHES = 4096  # batches the replay socket can still send to a router that missed them
END_OF_REPLAY = b"\xff" * 8


def encode(events: list[tuple], block_size: int, medium: str = RAM) -> list[dict]:
    """The pool's or the disk tier's events ("stored", digest, parent, token ids) / ("removed", digest) /
    ("cleared",) -> vLLM's event maps; consecutive stores of one chain go in one BlockStored, as vLLM sends them."""
    out: list[dict] = []
    for event in events:
        kind = event[0]
        if kind == "stored":
            _, digest, parent, tokens = event
            last = out[-1] if out else None
            if last is not None and last["type"] == "BlockStored" and last["block_hashes"][-1] == parent:
                last["block_hashes"].append(digest)
                last["token_ids"] += tokens
                continue
            out.append({"type": "BlockStored", "block_hashes": [digest], "parent_block_hash": parent,
                        "token_ids": list(tokens), "block_size": block_size, "lora_id": None, "medium": medium,
                        "lora_name": None})
        elif kind == "removed":
            last = out[-1] if out else None
            if last is not None and last["type"] == "BlockRemoved":
                last["block_hashes"].append(event[1])
            else:
                out.append({"type": "BlockRemoved", "block_hashes": [event[1]], "medium": medium})
        else:
            out.append({"type": "AllBlocksCleared"})
    return out


class KVEventPublisher:
    """A ZMQ PUB socket bound at `endpoint` (tcp://HOST:PORT), and, at `replay`, a ROUTER socket that resends
    recent batches from a sequence number on. `publish` is called from one thread (the step loop's)."""

    def __init__(self, endpoint: str, block_size: int, replay: str | None = None) -> None:
        import msgpack
        import zmq

        self._pack = msgpack.packb
        self.block_size = block_size
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(endpoint)
        self._seq = 0
        self._sent: deque[tuple[int, bytes]] = deque(maxlen=REPLAY_BATCHES)
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._replay = None
        if replay is not None:
            self._replay = threading.Thread(target=self._serve_replay, args=(replay,), name="kvserve-kv-replay", daemon=True)
            self._replay.start()
        self.publish([("cleared",)])

    def publish(self, events: list[tuple], disk_events: list[tuple] = ()) -> None:
        """One batch: what the pool gained and lost, then what the disk tier did."""
        if not events and not disk_events:
            return
        encoded = encode(events, self.block_size) + encode(disk_events, self.block_size, DISK)
        payload = self._pack([time.time(), encoded, 0], use_bin_type=True)
        with self._lock:
            seq, self._seq = self._seq, self._seq + 1
            self._sent.append((seq, payload))
        self._pub.send_multipart([b"", seq.to_bytes(8, "big", signed=True), payload])

    def _serve_replay(self, endpoint: str) -> None:
        import zmq

        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(endpoint)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        try:
            while not self._closing.is_set():
                if not poller.poll(100):
                    continue
                frames = sock.recv_multipart()
                if len(frames) != 3 or len(frames[2]) != 8:
                    continue  # not a replay request: [identity, empty, start]
                identity, start = frames[0], int.from_bytes(frames[2], "big")
                with self._lock:
                    batches = [(s, p) for s, p in self._sent if s >= start]
                for seq, payload in batches:
                    sock.send_multipart([identity, b"", b"", seq.to_bytes(8, "big", signed=True), payload])
                sock.send_multipart([identity, b"", b"", END_OF_REPLAY, b""])
        finally:
            sock.close()

    def close(self) -> None:
        self._closing.set()
        if self._replay is not None:
            self._replay.join(timeout=2)
        self._pub.close()
        self._ctx.term()

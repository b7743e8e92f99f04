"""The engine replica's own copy of which blocks its engine caches, from vLLM's KV events.

Routers follow each engine's event stream live; this mirror is what they resynchronise from
(on start, after a lost batch): `snapshot()` is the set of cached block keys together with
the sequence number it reflects. The mirror subscribes before the engine starts, so it sees
every batch from the first; should it ever miss one (ZMQ high-water mark), it fetches the
missing batches from vLLM's replay socket.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import Any

from rayattn.routing.kv_events import Snapshot, Tier, apply_batch, decoder

log = logging.getLogger("rayattn.engine")


def subscriber(ctx: Any, endpoint: str) -> Any:
    """A ZMQ SUB socket on an engine's KV event stream: everything, unbounded queue (a
    dropped batch would only force a resync), no linger on close."""
    import zmq

    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def node_ip() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:
        return "127.0.0.1"


class KVMirror:
    def __init__(self, pub_port: int, replay_port: int) -> None:
        self.pub_port, self.replay_port = pub_port, replay_port
        self._keys: dict[int, None] = {}
        self._offloaded: Counter[int] = Counter()
        """Host-tier blocks, counted: vLLM may announce one block in several chunks."""
        self._seq = -1
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-mirror", daemon=True)
        self._thread.start()

    # CacheSink, called with the lock held
    def stored(self, keys: list[int], tier: Tier) -> None:
        if tier == "gpu":
            self._keys.update(dict.fromkeys(keys))
        else:
            self._offloaded.update(keys)

    def removed(self, keys: list[int], tier: Tier) -> None:
        if tier == "gpu":
            for k in keys:
                self._keys.pop(k, None)
            return
        for k in keys:
            if self._offloaded[k] <= 1:
                self._offloaded.pop(k, None)
            else:
                self._offloaded[k] -= 1

    def cleared(self) -> None:
        self._keys.clear()
        self._offloaded.clear()

    def reset(self) -> None:
        """The engine's prefix cache and host tier were just emptied (reset_prefix_cache).
        vLLM publishes its AllBlocksCleared with the next engine step, which on an idle
        engine may be long after a router resyncs, and nothing at all for the host tier:
        clear now so no snapshot in between shows the old blocks."""
        with self._lock:
            self.cleared()

    def snapshot(self) -> Snapshot:
        with self._lock:
            return Snapshot(self._seq, list(self._keys), list(self._offloaded.elements()))

    @property
    def offloaded_blocks(self) -> int:
        return len(self._offloaded)

    def __len__(self) -> int:
        return len(self._keys)

    def close(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        import zmq

        ctx = zmq.Context.instance()
        sub = subscriber(ctx, f"tcp://127.0.0.1:{self.pub_port}")
        dec = decoder()
        while not self._stop.is_set():
            try:
                if not sub.poll(200):
                    continue
                parts = sub.recv_multipart()
                if len(parts) != 3:
                    continue
                seq = int.from_bytes(parts[1], "big")
                if seq > self._seq + 1 and self._seq >= 0:
                    self._replay(ctx, self._seq + 1, seq, dec)
                with self._lock:
                    if seq > self._seq:
                        apply_batch(dec.decode(parts[2]), self)
                        self._seq = seq
            except Exception:
                # One bad batch must not end the mirror: routers resync from it.
                log.exception("KV mirror: event batch skipped")
        sub.close()

    def _replay(self, ctx, start: int, upto: int, dec) -> None:
        import zmq

        req = ctx.socket(zmq.DEALER)
        req.setsockopt(zmq.LINGER, 0)
        req.connect(f"tcp://127.0.0.1:{self.replay_port}")
        req.send_multipart((b"", start.to_bytes(8, "big")))
        got = 0
        while req.poll(2000):
            frames = req.recv_multipart()
            if len(frames) < 4 or not frames[1]:  # END marker: (b"", b"", END_SEQ, b"")
                break
            seq = int.from_bytes(frames[2], "big")
            if start <= seq < upto:
                with self._lock:
                    apply_batch(dec.decode(frames[3]), self)
                    self._seq = seq
                got += 1
        req.close()
        if got < upto - start:
            log.error("KV mirror lost %d event batches that vLLM's replay buffer no longer "
                      "holds; routers will resync to an incomplete view",
                      upto - start - got)

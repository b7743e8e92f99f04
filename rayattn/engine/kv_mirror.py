"""The engine replica's own copy of which blocks its engine caches, from vLLM's KV events,
and the one door through which routers follow them.

vLLM publishes its events (token ids included: every tenant's prompts) on IPC sockets in a
directory only this replica's user can open; nothing of vLLM's listens on the network. The
mirror applies each batch and relays it on a CurveZMQ socket: encrypted, and readable only
by the routers that registered their public key through `admit` (a call over Ray, which the
routers already use for every request). Routers follow that stream live and
resynchronise from `snapshot()` (on start, after a lost batch): the set of cached block keys
together with the sequence number it reflects. The mirror subscribes before the engine
starts, but a ZMQ subscription takes effect some time after the connect (on a busy host,
after the first batches: a simulated engine serves at once); so until a batch arrives on it,
the mirror asks vLLM's replay socket for what was published meanwhile whenever the stream is
quiet, and any later gap (a batch dropped at the high-water mark) it fetches from the same
socket when the next batch shows it.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, NamedTuple

from rayattn.engine.mirrored_blocks import MirroredBlocks
from rayattn.integrations.vllm_kv_events import IPC_EVENT_MARK
from rayattn.routing.kv_events import Snapshot, apply_batch, decoder

log = logging.getLogger("rayattn.engine")


TOPIC = "kv"
"""The topic vLLM publishes the engine's events under, and the relay too."""

CLEARED_TOPIC = "cleared"
"""The mirror's own word on the relay, not vLLM's: the engine's cache was just emptied.
vLLM publishes its AllBlocksCleared with the engine's next step; on an idle engine that is
the next request, so every router but the one that asked for the reset would route the next
burst on blocks that are gone (first turns sent to their old engines as cache hits). It
carries the sequence number of the last
batch the mirror had applied, so a router whose snapshot is newer ignores it. Not a prefix
of TOPIC: a subscription to one is not one to the other."""

HWM = 10_000
"""Event batches a socket queues at most. A reader that falls further behind loses batches
and resyncs (a gap in the sequence numbers), instead of growing without bound."""

MAX_SUBSCRIBERS = 256
"""Router keys an engine admits at most (the oldest go first): routers come and go."""


class CurveKeys(NamedTuple):
    """A CurveZMQ key pair, Z85-encoded."""

    public: bytes
    secret: bytes

    @classmethod
    def new(cls) -> CurveKeys:
        import zmq

        return cls(*zmq.curve_keypair())


def subscriber(ctx: Any, endpoint: str, server_key: bytes | None = None,
               keys: CurveKeys | None = None, connect: bool = True) -> Any:
    """A ZMQ SUB socket on a KV event stream: everything, a bounded queue (a dropped batch
    only forces a resync), no linger on close; CurveZMQ with `server_key` (the publisher's
    public key) and this subscriber's `keys`. `connect=False`: the caller connects (after
    attaching a monitor, say)."""
    import zmq

    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.setsockopt(zmq.RCVHWM, HWM)
    sock.setsockopt(zmq.LINGER, 0)
    if server_key is not None and keys is not None:
        sock.curve_serverkey = server_key
        sock.curve_publickey, sock.curve_secretkey = keys
    if connect:
        sock.connect(endpoint)
    return sock


def private_ipc_endpoints(parent: str | None = None) -> tuple[str | None, str, str]:
    """(directory to remove when done, publisher, replay) for vLLM's event sockets: IPC files
    in `parent` (a private directory its maker removes: None is returned for it), else in a
    fresh directory that only this process's user may enter (mkdtemp makes it 0700). The
    names let vLLM derive one pair per DP rank (vllm_kv_events.dp_rank_endpoint)."""
    d = parent or tempfile.mkdtemp(prefix="rayattn-kv-")
    return (None if parent else d), f"ipc://{d}/{IPC_EVENT_MARK}-pub", \
        f"ipc://{d}/{IPC_EVENT_MARK}-replay"


def node_ip() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:
        return "127.0.0.1"


class KVMirror:
    def __init__(self, vllm_pub: str, vllm_replay: str, relay_host: str = "127.0.0.1",
                 ipc_dir: str | None = None, rank: int = 0) -> None:
        """Follows the engine's DP rank `rank` (vLLM's publisher of that rank at `vllm_pub`;
        its batches say whose they are)."""
        import zmq
        from zmq.auth.thread import ThreadAuthenticator

        self.vllm_pub, self.vllm_replay, self._ipc_dir = vllm_pub, vllm_replay, ipc_dir
        self.rank = rank
        # Its own context: one ZAP handler per context, and a process may hold two mirrors
        # (tests).
        self._ctx = ctx = zmq.Context()
        self._admitted: OrderedDict[bytes, None] = OrderedDict()
        # ZAP: the relay's handshakes are checked against the admitted router keys.
        self._auth = ThreadAuthenticator(ctx)
        self._auth.start()
        self._auth.configure_curve_callback("*", credentials_provider=self)
        keys = CurveKeys.new()
        self.server_key = keys.public
        self._relay = ctx.socket(zmq.PUB)
        self._relay.curve_server = True
        self._relay.curve_publickey, self._relay.curve_secretkey = keys
        self._relay.setsockopt(zmq.SNDHWM, HWM)
        self._relay.setsockopt(zmq.LINGER, 0)
        port = self._relay.bind_to_random_port(f"tcp://{relay_host}")
        self.endpoint = f"tcp://{relay_host}:{port}"
        """Where routers follow this engine's events (CurveZMQ, admitted keys only)."""
        self._blocks = MirroredBlocks()
        self._seq = -1
        """The sequence number of the last batch applied."""
        # Guards the view and the relay: a batch is applied and relayed as one step, and
        # reset() (on the replica's thread) clears and says so as one, so what routers are
        # told comes in the order the view changed. ZMQ allows a socket handed between
        # threads under a lock; a PUB send never blocks.
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-mirror", daemon=True)
        self._thread.start()

    # Router access
    def admit(self, router_key: bytes) -> None:
        """Let the router holding `router_key`'s secret follow the relay."""
        self._admitted[router_key] = None
        self._admitted.move_to_end(router_key)
        while len(self._admitted) > MAX_SUBSCRIBERS:
            self._admitted.popitem(last=False)

    def callback(self, domain: str, key: bytes) -> bool:
        """ZAP's question (on its own thread): may this key connect?"""
        return key in self._admitted

    def mark(self) -> int:
        """Where the view is now: taken before the engine's reset, handed to reset()."""
        with self._lock:
            return self._seq

    def reset(self, mark: int) -> None:
        """The engine's prefix cache and host tier were just emptied (reset_prefix_cache,
        called after mark() returned `mark`). vLLM publishes its AllBlocksCleared with the
        next engine step, which on an idle engine may be long after a router resyncs, and
        nothing at all for the host tier: clear now so no snapshot in between shows the old
        blocks, and tell the routers that follow (CLEARED_TOPIC). Unless that step already
        came (another router's request reached the engine meanwhile): then the view, and
        every router's, is past the reset, and the blocks stored since are real. (A clear
        that arrives late from an earlier reset reads the same; the blocks of the step that
        carried it then stay believed until this reset's own clear, as before the mirror
        said anything itself. A `cleared` lost on the way has no sequence number to show the
        gap: the same bound holds.)"""
        with self._lock:
            if self._blocks.vllm_cleared > mark or self._seq < 0:
                return  # past the reset already, or nothing was ever stored
            self._blocks.forget()
            try:
                self._publish((CLEARED_TOPIC.encode(), self._seq.to_bytes(8, "big"), b""))
            except Exception:
                # The engine was reset all the same; routers catch up at its next step.
                log.exception("KV mirror: could not tell routers of the reset")

    def _publish(self, parts: Sequence[bytes]) -> None:
        """On the relay; with the lock held."""
        if not self._relay.closed:
            self._relay.send_multipart(parts)

    def snapshot(self) -> Snapshot:
        with self._lock:
            return self._blocks.snapshot(self._seq)

    @property
    def offloaded_blocks(self) -> int:
        return self._blocks.offloaded_blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def close(self) -> None:
        """Stop following and relaying: the mirror's thread closes its sockets itself as it
        ends."""
        self._stop.set()
        self._thread.join(timeout=10)
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)

    def _run(self) -> None:
        ctx = self._ctx
        sub = subscriber(ctx, self.vllm_pub)
        dec = decoder()
        # Until a batch arrives on the subscription (proof that it took effect), every quiet
        # moment asks the replay socket for what was published meanwhile: a batch sent
        # before the subscription took effect, with none after it, is not lost either.
        subscribed = False
        while not self._stop.is_set():
            try:
                if not sub.poll(200):
                    if not subscribed:
                        self._replay(ctx, self._seq + 1, None, dec)
                    continue
                parts = sub.recv_multipart()
                if len(parts) != 3:
                    continue
                subscribed = True
                seq = int.from_bytes(parts[1], "big")
                if seq > self._seq + 1:
                    self._replay(ctx, self._seq + 1, seq, dec)
                self._apply(seq, dec.decode(parts[2]), parts)
            except Exception:
                # One bad batch must not end the mirror: routers resync from it.
                log.exception("KV mirror: event batch skipped")
        sub.close()
        with self._lock:
            self._relay.close()
        self._auth.stop()
        ctx.term()

    def _apply(self, seq: int, batch: Any, parts: Sequence[bytes]) -> None:
        """Batch `seq` (live or replayed) into the view, and on to the routers as `parts`."""
        if getattr(batch, "data_parallel_rank", None) not in (None, self.rank):
            # Another rank's publisher on this endpoint: the endpoints vLLM derives per rank
            # changed (vllm_kv_events.dp_rank_endpoint). Its blocks are not here.
            log.error("KV mirror of DP rank %d got rank %s's events; dropped",
                      self.rank, batch.data_parallel_rank)
            return
        with self._lock:
            if seq <= self._seq:
                return
            self._blocks.applying = seq
            apply_batch(batch, self._blocks)
            self._seq = seq
            self._publish(parts)

    def _replay(self, ctx: Any, start: int, upto: int | None, dec: Any) -> None:
        """Apply and relay the batches `start` <= seq < `upto` that vLLM's replay buffer
        holds; `upto=None`: all it holds from `start` (nothing while the engine has not
        started: its replay socket is not bound yet, and the wait for an answer ends after
        two seconds, the subscription's batches queueing meanwhile)."""
        import zmq

        req = ctx.socket(zmq.DEALER)
        req.setsockopt(zmq.LINGER, 0)
        req.connect(self.vllm_replay)
        req.send_multipart((b"", start.to_bytes(8, "big")))
        got = 0
        while req.poll(2000):
            frames = req.recv_multipart()
            if len(frames) < 4 or not frames[1]:  # END marker: (b"", b"", END_SEQ, b"")
                break
            seq = int.from_bytes(frames[2], "big")
            if seq >= start and (upto is None or seq < upto):
                self._apply(seq, dec.decode(frames[3]), (TOPIC.encode(), frames[2], frames[3]))
                got += 1
        req.close()
        if upto is not None and got < upto - start:
            log.error("KV mirror lost %d event batches that vLLM's replay buffer no longer "
                      "holds; routers will resync to an incomplete view",
                      upto - start - got)

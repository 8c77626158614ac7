"""A subscriber of one engine's KV-event stream.

vLLM publishes with ``--kv-events-config '{"enable_kv_cache_events": true,
"publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "kv"}'``: a ZMQ PUB
socket sends each ``KVEventBatch`` as three frames (topic, an 8-byte
big-endian sequence number counting from 0, the batch as msgspec msgpack).
With ``"replay_endpoint": "tcp://*:5558"`` too, a ROUTER socket there
answers a request (an empty delimiter and an 8-byte start sequence number)
with every batch it still buffers (``buffer_steps``) from that number on,
each as (empty, topic, sequence, payload), then an end marker of sequence
-1.

    sub = EventSubscriber("tcp://node1:5557", sink=print, topic="kv",
                          replay_endpoint="tcp://node1:5558")   # optional
    sub.start(); ...; sub.stats(); sub.close()

Every batch is decoded with vLLM's own ``KVEventBatch`` type and handed to
``sink`` in sequence order. With a replay endpoint, ``start`` first asks it
for everything it buffers (a router that joins running engines learns what
they already hold), and a hole in the live sequence is asked for before
the batch that revealed it; ``recovered`` counts the batches replayed.
What never reached ``sink`` is counted: ``missed_at_join``, the batches
before the first one handed over; ``gaps``, the holes after it (a PUB
socket drops what a slow subscriber cannot take once the high-water marks
fill, and a subscription takes effect a little after ``connect``). A
sequence number that goes back means the publisher restarted:
``on_restart`` is called (that engine's GPU cache is empty again) and
``restarts`` counted. ``lag_s`` is the time from a live batch's timestamp
(the engine's clock) to its hand-off (this host's clock).

Thread ownership: ``start`` starts one thread, which owns the sockets and
calls ``sink`` and ``on_restart``; ``close`` stops and joins it. ``stats``
and ``wait_for`` may be called from any thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from kvtier.errors import ConfigError

log = logging.getLogger(__name__)

END_SEQ = -1
_POLL_MS = 100


def check_endpoint(endpoint: str, key: str = "endpoint") -> str:
    """A ZMQ address to connect to: ``tcp://HOST:PORT`` or ``ipc://PATH``."""
    if not endpoint.startswith(("tcp://", "ipc://")) or "*" in endpoint:
        raise ConfigError(key, f"{endpoint!r} is no address to connect to",
                          "give the engine's host and port, e.g. tcp://node1:5557 (not its bind address tcp://*:5557)")
    if endpoint.startswith("tcp://") and not endpoint.rpartition(":")[2].isdigit():
        raise ConfigError(key, f"{endpoint!r} names no port", "e.g. tcp://node1:5557")
    return endpoint


def split_endpoint(text: str, key: str = "endpoint") -> tuple[str, str | None]:
    """``URL`` or ``URL?replay=URL``: the stream and its replay endpoint."""
    url, _, query = text.partition("?")
    replay = None
    if query:
        name, eq, replay = query.partition("=")
        if name != "replay" or not eq:
            raise ConfigError(key, f"{text!r}: the only option is ?replay=URL",
                              "e.g. tcp://node1:5557?replay=tcp://node1:5558")
        check_endpoint(replay, key)
    return check_endpoint(url, key), replay


class EventSubscriber:
    def __init__(self, endpoint: str, sink: Callable[[Any], None], *, topic: str = "",
                 replay_endpoint: str | None = None, on_restart: Callable[[], None] | None = None,
                 rcvhwm: int = 100_000, replay_timeout_s: float = 2.0):
        self.endpoint = check_endpoint(endpoint)
        self.replay_endpoint = check_endpoint(replay_endpoint, "replay_endpoint") if replay_endpoint else None
        self.topic = topic
        self._sink = sink
        self._on_restart = on_restart
        self._rcvhwm = rcvhwm                      # batches queued here before the PUB side drops
        self._replay_timeout_s = replay_timeout_s  # silence that ends a replay
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._ready = threading.Event()
        # Live batches up to this sequence number were already replayed at start.
        self._replayed_upto: int | None = None
        self._cond = threading.Condition()  # guards _last and _stats
        self._last: int | None = None       # sequence number of the last batch handed to sink
        self._stats = {"batches": 0, "events": 0, "first_seq": None, "missed_at_join": 0, "gaps": 0,
                       "recovered": 0, "restarts": 0, "undecodable": 0, "sink_errors": 0,
                       "lag_s_last": 0.0, "lag_s_max": 0.0, "lag_s_sum": 0.0, "error": None}

    # ------------------------------------------------------------ caller's side

    def start(self, timeout_s: float = 60.0) -> None:
        """Import zmq and vLLM's event types (an ImportError here names what
        to install), then connect and replay on the subscriber's thread;
        return once both are done."""
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self._thread = threading.Thread(target=self._run, args=(zmq, decoder, msgspec),
                                        name=f"kvtier-events-{self.endpoint}", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise RuntimeError(f"events subscriber for {self.endpoint} did not start within {timeout_s} s")
        if self._stats["error"]:
            raise RuntimeError(f"events subscriber for {self.endpoint}: {self._stats['error']}")

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> EventSubscriber:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def stats(self) -> dict:
        """Counters so far, plus ``last_seq`` and ``lag_s_mean`` (over the
        batches received live; ``lag_s_sum`` is its numerator)."""
        with self._cond:
            out = dict(self._stats)
            out["last_seq"] = self._last
        n = out["batches"] - out["recovered"]
        out["lag_s_mean"] = out["lag_s_sum"] / n if n > 0 else 0.0
        return out

    def wait_for(self, seq: int, timeout_s: float) -> bool:
        """Whether batch ``seq`` (or a later one) was handed to ``sink``
        within ``timeout_s``."""
        with self._cond:
            return self._cond.wait_for(lambda: self._last is not None and self._last >= seq, timeout_s)

    # ------------------------------------------------------------ the subscriber's thread

    def _run(self, zmq, decoder, msgspec) -> None:
        sock = None
        try:
            sock = zmq.Context.instance().socket(zmq.SUB)
            sock.setsockopt(zmq.RCVHWM, self._rcvhwm)
            sock.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
            sock.connect(self.endpoint)
            if self.replay_endpoint:
                self._replay(0, None, zmq, decoder, msgspec)
                self._replayed_upto = self._last
            self._ready.set()
            while not self._stop.is_set():
                if sock.poll(_POLL_MS):
                    self._receive(sock.recv_multipart(), zmq, decoder, msgspec)
        except Exception as exc:  # the thread's owner reads it from stats() (and start())
            log.exception("events subscriber for %s stopped", self.endpoint)
            with self._cond:
                self._stats["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            self._ready.set()
            if sock is not None:
                sock.close(linger=0)

    def _receive(self, frames: list[bytes], zmq, decoder, msgspec) -> None:
        if len(frames) != 3:
            with self._cond:
                self._stats["undecodable"] += 1
            return
        seq = int.from_bytes(frames[1], "big", signed=True)
        upto, last = self._replayed_upto, self._last
        if upto is not None:
            if seq <= upto:
                return  # replayed at start already
            self._replayed_upto = None
        if last is not None and seq <= last:
            with self._cond:
                self._stats["restarts"] += 1
                self._last = last = -1  # the new run's batches before seq are holes
            if self._on_restart is not None:
                self._call(self._on_restart)
        start = 0 if last is None else last + 1
        if self.replay_endpoint and start < seq:
            self._replay(start, seq, zmq, decoder, msgspec)
        self._deliver(seq, frames[2], decoder, msgspec, live=True)

    def _replay(self, start: int, stop: int | None, zmq, decoder, msgspec) -> None:
        """Hand ``sink`` the batches from ``start`` (up to ``stop``, if
        given) that the engine's replay buffer still holds."""
        sock = zmq.Context.instance().socket(zmq.DEALER)
        try:
            sock.connect(self.replay_endpoint)
            sock.send_multipart((b"", start.to_bytes(8, "big")))
            while sock.poll(int(self._replay_timeout_s * 1000)):
                frames = sock.recv_multipart()
                if len(frames) != 4:
                    continue
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq == END_SEQ:
                    return
                if seq >= start and (stop is None or seq < stop) and (self._last is None or seq > self._last):
                    self._deliver(seq, frames[3], decoder, msgspec, live=False)
            log.warning("replay from %s: no end marker within %s s", self.replay_endpoint, self._replay_timeout_s)
        finally:
            sock.close(linger=0)

    def _deliver(self, seq: int, payload: bytes, decoder, msgspec, live: bool) -> None:
        """Decode one batch, hand it to ``sink``, count it and the hole
        before it."""
        try:
            batch = decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            batch = None
        ok = batch is not None and self._call(self._sink, batch)
        lag = time.time() - batch.ts if batch is not None else 0.0
        with self._cond:
            s = self._stats
            if self._last is None:
                s["first_seq"] = s["missed_at_join"] = seq
            else:
                s["gaps"] += seq - self._last - 1
            self._last = seq
            if batch is None:
                s["undecodable"] += 1
            else:
                s["batches"] += 1
                s["events"] += len(batch.events)
                s["sink_errors"] += not ok
                if live:
                    s["lag_s_last"] = lag
                    s["lag_s_max"] = max(s["lag_s_max"], lag)
                    s["lag_s_sum"] += lag
                else:
                    s["recovered"] += 1
            self._cond.notify_all()

    def _call(self, fn: Callable, *args) -> bool:
        try:
            fn(*args)
            return True
        except Exception:  # counted in stats(); the stream goes on
            log.exception("events subscriber for %s: handing a batch on failed", self.endpoint)
            return False

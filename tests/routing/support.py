"""vLLM's own KV-event publisher on loopback, and events to publish with it.

``Engine`` is what a vLLM engine started with ``--kv-events-config`` runs:
a ``ZmqEventPublisher`` bound to a free TCP port (and a replay ROUTER
where asked), publishing ``KVEventBatch``es of real ``BlockStored`` /
``BlockRemoved`` / ``AllBlocksCleared`` events. It counts the batches it
sent, so a test knows each batch's sequence number.
"""

from __future__ import annotations

import socket
import time

from vllm.distributed.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch,
                                        ZmqEventPublisher)

BS = 16  # tokens per block


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Engine:
    def __init__(self, replay: bool = False, hwm: int = 100_000, topic: str = "kv", port: int | None = None):
        port = port or free_port()
        self.port = port
        self.url = f"tcp://127.0.0.1:{port}"
        self.replay_url = None
        replay_bind = None
        if replay:
            rport = free_port()
            self.replay_url, replay_bind = f"tcp://127.0.0.1:{rport}", f"tcp://*:{rport}"
        # What a router is given: the stream, and its replay endpoint where there is one.
        self.spec = f"{self.url}?replay={self.replay_url}" if replay else self.url
        self.publisher = ZmqEventPublisher(0, endpoint=f"tcp://*:{port}", replay_endpoint=replay_bind,
                                           hwm=hwm, topic=topic)
        self.sent = 0  # batches published: the next batch's sequence number

    def publish(self, *events, ts: float | None = None) -> int:
        """Publish one batch; its sequence number."""
        self.publisher.publish(KVEventBatch(ts=time.time() if ts is None else ts, events=list(events)))
        self.sent += 1
        return self.sent - 1

    def join(self, subscriber, timeout_s: float = 20.0) -> int:
        """Publish empty batches until ``subscriber`` has one (a PUB socket
        drops what it sends before it knows of a subscription); the
        sequence number of the batch it got first."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            seq = self.publish()
            if subscriber.wait_for(seq, 0.05):
                return subscriber.stats()["first_seq"]
        raise AssertionError(f"no batch from {self.url} reached the subscriber in {timeout_s} s")

    def send(self, subscriber, *events, timeout_s: float = 10.0) -> int:
        """Publish one batch and wait until ``subscriber`` handed it on."""
        seq = self.publish(*events)
        assert subscriber.wait_for(seq, timeout_s), f"batch {seq} from {self.url} not received"
        return seq

    def close(self) -> None:
        self.publisher.shutdown()


def stored(hashes, parent, tokens, *, medium=None, locality=None, ownership=None, extra=None, size=BS):
    return BlockStored(block_hashes=list(hashes), parent_block_hash=parent, token_ids=list(tokens),
                       block_size=size, lora_id=None, medium=medium, lora_name=None, extra_keys=extra,
                       locality=locality, ownership=ownership)


def removed(hashes, *, medium=None, locality=None, ownership=None):
    return BlockRemoved(block_hashes=list(hashes), medium=medium, locality=locality, ownership=ownership)


def cleared():
    return AllBlocksCleared()


def prompt(seed: int, blocks: int, tail: int = 5) -> list[int]:
    """``blocks`` whole blocks of distinct token ids, then ``tail`` more."""
    return [1000 * seed + i for i in range(blocks * BS + tail)]


def block(tokens, i: int) -> list[int]:
    return list(tokens[i * BS:(i + 1) * BS])

"""The worker's device data path (CUDA, and ROCm through torch's HIP
streams): copies between engine pages on the device and chunk payloads in
host memory that never make the engine's thread wait for the copy.

- **Pinned, reused staging.** Each copy goes through a page-locked host
  buffer from a small pool (``Staging``): device-to-host and host-to-device
  copies from pinned memory run asynchronously at the bus's speed, and the
  pool spares a pin per step.
- **A copy stream ordered with events.** A save is enqueued on kvtier's own
  stream after an event recorded on the engine's stream once the step's
  forward is enqueued (the pages are written by then); a load is enqueued
  the same way behind the engine's work. The engine's stream then waits on
  the copy's event (on the device: the host does not block), so a later
  forward never overwrites pages a save still reads, nor reads pages a load
  still writes.
- **Done means done.** A save's bytes reach the store only after its event
  completed (the saver thread waits on it); a load is reported finished to
  vLLM only once its copies' events completed (``Pending.done``), and a
  staging buffer is reused only after its event completed.

On CPU the worker copies pages directly (``PageLayout``'s memmove path);
this module is used only for device tensors. Its stream and event calls
sit behind ``Runtime`` so the ordering can be tested without a GPU.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from kvtier.integrations.vllm.layout import PageLayout


class Runtime:
    """torch.cuda's streams, events and pinned memory for one device."""

    def __init__(self, device: torch.device):
        self.device = device
        self.copy_stream = torch.cuda.Stream(device=device)

    def mark(self) -> Any:
        """An event recorded now on the engine's (current) stream."""
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def copying(self, after: Any):
        """Context in which work goes to the copy stream, behind ``after``."""
        self.copy_stream.wait_event(after)
        return torch.cuda.stream(self.copy_stream)

    def done_event(self) -> Any:
        ev = torch.cuda.Event()
        ev.record(self.copy_stream)
        return ev

    def engine_waits(self, ev: Any) -> None:
        torch.cuda.current_stream(self.device).wait_event(ev)

    def pinned(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


class Staging:
    """Pinned host buffers, reused: ``take`` one of at least ``nbytes``,
    ``give`` it back once the copy that used it completed."""

    def __init__(self, runtime: Runtime, keep: int = 8):
        self.runtime = runtime
        self.keep = keep
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self.allocated = 0

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            for i, buf in enumerate(self._free):
                if buf.numel() >= nbytes:
                    return self._free.pop(i)
            self.allocated += 1
        return self.runtime.pinned(nbytes)

    def give(self, buf: torch.Tensor) -> None:
        with self._lock:
            if len(self._free) < self.keep:
                self._free.append(buf)


@dataclass
class Pending:
    """One enqueued copy: ``done`` completes when its bytes have moved."""

    done: Any
    staging: torch.Tensor
    shape: tuple[int, ...]
    nbytes: int
    released: bool = field(default=False)

    def finished(self) -> bool:
        return bool(self.done.query())


class DevicePath:
    def __init__(self, layout: PageLayout, runtime: Runtime | None = None, staging: Staging | None = None):
        self.layout = layout
        self.runtime = runtime or Runtime(layout.device)
        self.staging = staging or Staging(self.runtime)

    def _host_view(self, buf: torch.Tensor, shape, nbytes: int) -> torch.Tensor:
        return buf[:nbytes].view(self.layout.dtype).view(shape)

    def save(self, block_ids: Sequence[int]) -> Pending:
        """Enqueue the gather of ``block_ids``' pages into pinned memory,
        behind this step's forward; the engine's stream waits for it."""
        shape = self.layout.chunk_shape(len(block_ids))
        nbytes = len(block_ids) * self.layout.page_bytes * len(self.layout.layers)
        buf = self.staging.take(nbytes)
        after = self.runtime.mark()
        with self.runtime.copying(after):
            self.layout.gather(block_ids, self._host_view(buf, shape, nbytes))
            done = self.runtime.done_event()
        self.runtime.engine_waits(done)
        return Pending(done, buf, shape, nbytes)

    def saved_bytes(self, p: Pending) -> memoryview:
        """The saved payload (call once ``p.done`` completed: the saver
        thread synchronizes on it first)."""
        p.done.synchronize()
        return memoryview(p.staging[: p.nbytes].numpy()).cast("B")

    def load(self, block_ids: Sequence[int], payload: memoryview, shape, first: int = 0) -> Pending:
        """Copy ``payload`` (a chunk's pages, ``shape``) into pinned memory,
        then enqueue host-to-device and the scatter into ``block_ids[first:]``
        behind the engine's work; the engine's stream waits for it."""
        nbytes = len(payload)
        buf = self.staging.take(nbytes)
        buf[:nbytes].numpy()[:] = memoryview(payload).cast("B")
        after = self.runtime.mark()
        with self.runtime.copying(after):
            src = self._host_view(buf, shape, nbytes)
            self.layout.scatter(block_ids, self.layout.leading_blocks(src, len(block_ids)), first=first)
            done = self.runtime.done_event()
        self.runtime.engine_waits(done)
        return Pending(done, buf, shape, nbytes)

    def release(self, p: Pending) -> None:
        """Return ``p``'s staging buffer (its copy must have completed)."""
        if not p.released:
            p.done.synchronize()
            p.released = True
            self.staging.give(p.staging)

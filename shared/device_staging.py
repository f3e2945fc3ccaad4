"""KV between an engine's pages and the host buffers a transfer reads or writes, wherever the pages are.

The Transfer Engine and the pool client move registered host memory only (no GPUDirect here). Four copies take
KV across that line: a handoff's gather into a staging buffer (prefill) and its scatter from a landing slot
(decode), a pool save's pack into its put buffer and a restore's unpack from its read buffer. `KVStaging` makes
each of them one of two ways:
- pages in host memory the transfer engine may register (CPU pages, `transfer.register_pages` true): the kernel
  copies straight between the pages and the host buffer, as it always did: no extra copy;
- foreign pages (a GPU's; or CPU pages with `register_pages` false, so that every CPU test run takes this path):
  the kernel runs on the pages' device into or out of a scratch buffer there, and one bulk copy moves the bytes
  between scratch and host buffer. The scratch is one per KVStaging, grown (in whole MiB) as needed, never
  allocated per call.
  On CUDA the host buffers are pinned (`host_buffer`: one DMA, no bounce through a driver buffer), and kernel and
  copy run on a stream of their own: they queue behind what the engine submitted before (the pages' writes),
  not behind what it submits later. The call waits for that stream before it returns: the host bytes are final
  (gather, pack), or no longer read (scatter, unpack: the slot or buffer may be reused at once), and the scratch
  is free for the next call.
CRCs are computed over the host bytes, as the transfer sends or received them: a pack's after the copy to the
host, an unpack's while the copy to the device is in flight. As before, a caller that finds an unpack's CRC wrong
must not use the blocks written (they hold the bad bytes).
Concurrent callers (handoffs gathering at once; decode's scatter threads and the seam tokens its event loop
scatters) share the scratch under a lock: one foreign copy at a time per KVStaging.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from kernels import get_kv_kernels
from shared.handoff_check import checksum

if TYPE_CHECKING:
    from kernels.reference import IndexLike
    from shared.kv_layout import KVLayout

SCRATCH_GRAIN = 1 << 20  # the scratch grows in whole MiB


def registrable(pages: Sequence[torch.Tensor], register_pages: bool) -> bool:
    """Whether the transfer engine and the pool client may use the pages themselves (direct handoff, in-place
    restore, kernels straight into host buffers): host memory, and `transfer.register_pages` true."""
    return register_pages and all(p.device.type == "cpu" for p in pages)


def host_buffer(nbytes: int, device: torch.device | str) -> torch.Tensor:
    """A uint8 host buffer for KV going to or coming from pages on `device`: pinned when that is a CUDA device
    (so the copy between them is one asynchronous DMA), plain host memory otherwise."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.device(device).type == "cuda")


class KVStaging:
    """The KV copies between one engine's pages and host buffers (see the module docstring for the two ways).

    Invariant: `_scratch` is only touched under `_lock`, and no device work on it is pending when the lock is
    released (the copy stream was waited for), so it can be reused, or replaced by a larger one, at once.
    """

    def __init__(self, pages: Sequence[torch.Tensor], register_pages: bool = True):
        self.device = pages[0].device
        self.kernels = get_kv_kernels(self.device)
        self.foreign = not registrable(pages, register_pages)
        self._lock = threading.Lock()
        self._scratch = torch.empty(0, dtype=torch.uint8, device=self.device)
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def gather(self, stage_pages: list[torch.Tensor], block_table: IndexLike, num_tokens: int, layout: KVLayout,
               out: torch.Tensor, first: int = 0) -> None:
        """Tokens [first, num_tokens) of one decode rank (cp 1: every token) -> host buffer `out` (gather_for_ranks)."""
        if not self.foreign:
            self.kernels.gather_for_ranks(stage_pages, block_table, num_tokens, 1, layout, [out], first=first)
            return
        with self._scratch_for(out) as dev:
            self.kernels.gather_for_ranks(stage_pages, block_table, num_tokens, 1, layout, [dev], first=first)
            out.copy_(dev, non_blocking=True)

    def scatter(self, buf: torch.Tensor, pages: torch.Tensor, block_table: IndexLike, num_tokens: int,
                first: int = 0) -> None:
        """Host buffer `buf` (a rank's tokens [first, first + num_tokens)) -> the pages (scatter_from_rank)."""
        if not self.foreign:
            self.kernels.scatter_from_rank(buf, pages, block_table, num_tokens, first)
            return
        with self._scratch_for(buf) as dev:
            dev.copy_(buf, non_blocking=True)
            self.kernels.scatter_from_rank(dev, pages, block_table, num_tokens, first)

    def pack_crc(self, pages_s: torch.Tensor, block_ids: IndexLike, out: torch.Tensor) -> int:
        """Blocks of one stage -> host buffer `out` (pack_chunk); returns the CRC-32C of `out`'s bytes. An `out`
        of another dtype (a compact pool object) gets the values converted: on host pages in the kernel's copy,
        on foreign ones on their device before the bytes leave it."""
        if not self.foreign:
            return self.kernels.pack_chunk_crc(pages_s, block_ids, out)
        with self._scratch_for(out) as dev:
            if dev.dtype == pages_s.dtype:
                self.kernels.pack_chunk(pages_s, block_ids, out=dev)
            else:
                dev.view(-1).copy_(self.kernels.pack_chunk(pages_s, block_ids).view(-1))
            out.copy_(dev, non_blocking=True)
        return checksum(out)

    def unpack_crc(self, buf: torch.Tensor, pages_s: torch.Tensor, block_ids: IndexLike) -> int:
        """Host buffer `buf` -> blocks of one stage (unpack_chunk); returns the CRC-32C of `buf`'s bytes (wrong:
        the blocks hold bad bytes and must not be used). A `buf` of another dtype is widened (compact objects)."""
        if not self.foreign:
            return self.kernels.unpack_chunk_crc(buf, pages_s, block_ids)
        with self._scratch_for(buf) as dev:
            dev.copy_(buf, non_blocking=True)
            crc = checksum(buf)  # the host's copy of the bytes, while the device's is in flight
            self.kernels.unpack_chunk(dev if dev.dtype == pages_s.dtype else dev.to(pages_s.dtype), pages_s,
                                      block_ids)
        return crc

    @contextlib.contextmanager
    def _scratch_for(self, host: torch.Tensor) -> Iterator[torch.Tensor]:
        """The scratch, on the pages' device, viewed like the contiguous host buffer `host`, for one copy: under
        the lock; on CUDA with the copy stream current, and waited for on the way out."""
        if host.device.type != "cpu" or not host.is_contiguous():
            shape = "contiguous" if host.is_contiguous() else "strided"
            raise ValueError(f"KV staging needs a contiguous host buffer, got a {shape} one on {host.device}")
        nbytes = host.numel() * host.element_size()
        with self._lock:
            if self._scratch.numel() < nbytes:  # whole MiB: a window a token longer than the last fits
                self._scratch = torch.empty(-(-nbytes // SCRATCH_GRAIN) * SCRATCH_GRAIN, dtype=torch.uint8,
                                            device=self.device)
            dev = self._scratch[:nbytes].view(host.dtype).view(host.shape)
            if self._stream is None:
                yield dev
                return
            self._stream.wait_stream(torch.cuda.current_stream(self.device))  # the pages' earlier writes and reads
            try:
                with torch.cuda.stream(self._stream):
                    yield dev
            finally:
                self._stream.synchronize()

"""Checksums of handed-off KV: what prefill wrote into a landing slot is what decode adopts, or nothing.

Prefill computes a CRC-32C over exactly the bytes of each write (one landing slot's `nbytes`, in the
thread that gathered them) and sends it in `SlotsFilled.crcs`, one per piece, in the order of `pieces`.
Decode checks each landed slot against it in the thread that scatters, before a byte reaches its pages.
A mismatch, or a SlotsFilled without checksums, fails that request (prefill turns the refusal into a
503, the router retries it once when the client has received nothing yet): never wrong tokens.

CRC-32C (Castagnoli) as shared/kv_object.checksum computes it: the C kernel's (kernels/cpu_crc.py: folded
with VPCLMULQDQ where the CPU has it, 8 MiB in cache in 0.19 ms on one core of the 2-core dev box; else
three interleaved lanes of the CRC instruction, 0.55 ms), else the `crc32c` package (SSE4.2 / ARMv8 CRC
instructions where the CPU has them). Both release the GIL, so the event loop keeps running meanwhile. Measured earlier, 8 MiB: crc32c 0.35-0.44 ms, zlib.crc32
2.4-4.7 ms, google-crc32c 0.4 ms but it holds the GIL for the whole call.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from shared.kv_object import checksum as kv_checksum

ALGORITHM = "crc32c"
_CRC_MAX = 1 << 32

# Decode's refusals, as it puts them in the Ack (stable texts: nothing parses them, they are logged).
MISMATCH = "KV checksum mismatch: the landed bytes differ from what prefill wrote"
UNVERIFIED = "KV arrived without checksums: this decode requires SlotsFilled.crcs (upgrade the prefill)"
FAULT_ENV = "MOORAGE_FAULT_CORRUPT_LANDING"  # decode's fault injection for tests (LandingFaults)


def checksum(buf: torch.Tensor) -> int:
    """CRC-32C of a contiguous CPU tensor's bytes (any dtype; read in place, no copy)."""
    if buf.device.type != "cpu" or not buf.is_contiguous():
        raise ValueError("checksum needs a contiguous CPU tensor")
    return kv_checksum(buf.reshape(-1).view(torch.uint8))


@dataclass(frozen=True)
class Piece:
    """One write of a handoff: bytes [offset, offset + nbytes) of the request's rank buffer, landed in
    slot `slot_id`, whose CRC-32C prefill computed as `crc`."""
    slot_id: int
    offset: int
    nbytes: int
    crc: int

    def wire(self) -> list[int]:
        """The piece as SlotsFilled.pieces carries it (the crc travels in SlotsFilled.crcs)."""
        return [self.slot_id, self.offset, self.nbytes]


def to_wire(pieces: list[Piece]) -> tuple[list[list[int]], list[int]]:
    """(SlotsFilled.pieces, SlotsFilled.crcs)."""
    return [p.wire() for p in pieces], [p.crc for p in pieces]


class Unverified(ValueError):
    """The SlotsFilled carries no checksum for its pieces (an older sender)."""


def parse(pieces: list, crcs: list) -> list[Piece]:
    """SlotsFilled's pieces and crcs -> Pieces. Raises Unverified when the checksums are missing, and
    ValueError (with the reason) when either list is malformed."""
    if not crcs and pieces:
        raise Unverified(UNVERIFIED)
    if len(crcs) != len(pieces):
        raise ValueError(f"{len(crcs)} checksums for {len(pieces)} pieces")
    out = []
    for raw, crc in zip(pieces, crcs):
        if not isinstance(raw, (list, tuple)) or len(raw) != 3 \
                or not all(type(v) is int and v >= 0 for v in raw):
            raise ValueError(f"bad piece {raw!r}: expected [slot_id, offset, nbytes] of non-negative ints")
        if type(crc) is not int or not 0 <= crc < _CRC_MAX:
            raise ValueError(f"bad checksum {crc!r}: expected an unsigned 32-bit int")
        out.append(Piece(*raw, crc))
    return out


def verify(landed: torch.Tensor, piece: Piece) -> str | None:
    """None when `landed` (the slot's first nbytes) is exactly what prefill wrote for `piece`; else why not."""
    size = landed.numel() * landed.element_size()
    if size != piece.nbytes:
        return f"size {size} != {piece.nbytes}"
    got = checksum(landed)
    if got != piece.crc:
        return f"{MISMATCH} (slot {piece.slot_id}, bytes [{piece.offset}, {piece.offset + piece.nbytes}): " \
               f"crc32c {got:08x}, prefill sent {piece.crc:08x})"
    return None


@dataclass
class HandoffChecks:
    """Counters of landed-piece verification (load report detail, as handoff_crc_*)."""
    verified: int = 0    # pieces whose bytes matched their checksum
    failures: int = 0    # pieces whose bytes did not: their request failed, nothing was adopted
    unverified: int = 0  # SlotsFilled refused for carrying no checksums

    def detail(self) -> dict:
        return {"handoff_crc_verified": self.verified, "handoff_crc_failures": self.failures,
                "handoff_crc_unverified": self.unverified}


@dataclass
class LandingFaults:
    """Fault injection for tests, off by default: corrupt the first `corrupt_pieces` landed pieces."""
    corrupt_pieces: int = 0

    @classmethod
    def from_env(cls) -> LandingFaults:
        raw = os.environ.get(FAULT_ENV, "").strip() or "0"
        if not raw.isdigit():
            raise ValueError(f"{FAULT_ENV} must be a count of pieces to corrupt, got {raw!r}")
        return cls(int(raw))

    def apply(self, landed) -> bool:
        """Flip one byte of `landed` (a slot's uint8 view) while any corruption is left; True if it did."""
        if self.corrupt_pieces <= 0 or landed.numel() == 0:
            return False
        self.corrupt_pieces -= 1
        i = landed.numel() // 2
        landed[i] = landed[i] ^ 0x5A
        return True

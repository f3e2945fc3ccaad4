"""Every message on the bus, in one place. msgpack maps with a schema version and a kind.

Each message is a msgspec Struct: its fields are the wire schema, typed all the way down (the sampling
parameters travel as the one SamplingParams struct the router built, checked by its own __post_init__ on
every decode). Decoding tolerates unknown message fields (a newer sender may add some) and rejects a wrong
kind, a newer major version, a missing required field or a value of the wrong type with a MessageError that
names the field's path.
KV bytes never travel here: see shared/bus.py for the size guard.

Token id lists (fields typed `TokenIds`) travel packed: one msgpack bin of little-endian uint32, 4 bytes
per id whatever the vocabulary (a whole 1M-token context is 4 MB), decoded back to a list of ints. A
plain list is still accepted on decode (older senders).
"""

from __future__ import annotations

import typing
from typing import Annotated, ClassVar

import msgspec
import numpy as np

from shared.engine.sampling import SamplingParams, TokenLogprob

SCHEMA_VERSION = 1


class MessageError(ValueError):
    pass


_PACKED = "uint32-le"
TokenIds = Annotated[list[int], _PACKED]  # a list of token ids, packed on the wire


def pack_token_ids(ids) -> bytes:
    """Little-endian uint32 bytes; an id outside [0, 2**32) is a MessageError, never a wrapped value."""
    arr = np.asarray(ids)
    if arr.size == 0:
        return b""
    if arr.ndim != 1 or arr.dtype.kind not in "iu" or arr.min() < 0 or arr.max() >= 1 << 32:
        raise MessageError("token ids must be integers in [0, 2**32)")
    return arr.astype("<u4", copy=False).tobytes()


def unpack_token_ids(raw: bytes) -> list[int]:
    if len(raw) % 4:
        raise MessageError(f"packed token ids: {len(raw)} bytes is not a multiple of 4")
    return np.frombuffer(raw, dtype="<u4").tolist()


def _packed_fields(cls) -> frozenset[str]:
    hints = typing.get_type_hints(cls, include_extras=True)
    return frozenset(name for name, tp in hints.items()
                     if typing.get_origin(tp) is Annotated and _PACKED in tp.__metadata__)


class Message(msgspec.Struct):
    """A bus message: a msgspec Struct whose fields are its wire schema. Decoding converts the msgpack map
    with msgspec (strict types, nested structs such as SamplingParams checked by their own __post_init__),
    after unpacking the TokenIds fields; an error names the field."""
    KIND: ClassVar[str]
    PACKED: ClassVar[frozenset[str]] = frozenset()  # TokenIds fields (set by @message)

    def to_dict(self) -> dict:
        return msgspec.structs.asdict(self)

    def encode(self) -> bytes:
        data = self.to_dict()
        for name in self.PACKED:
            data[name] = pack_token_ids(data[name])
        try:
            return _ENCODER.encode({"v": SCHEMA_VERSION, "kind": self.KIND, **data})
        except (TypeError, OverflowError) as e:
            raise MessageError(f"{self.KIND}: cannot encode ({e})") from None

    @classmethod
    def from_dict(cls, data: dict) -> "Message":
        data = dict(data)
        for name in cls.PACKED:
            if isinstance(data.get(name), bytes):
                data[name] = unpack_token_ids(data[name])
        try:
            return msgspec.convert(data, cls)
        except msgspec.ValidationError as e:
            raise MessageError(_field_path(cls, str(e))) from None

    @classmethod
    def decode(cls, raw: bytes) -> "Message":
        try:
            data = _DECODER.decode(raw)
        except Exception as e:
            raise MessageError(f"{cls.__name__}: not valid msgpack ({type(e).__name__}: {e})") from None
        if not isinstance(data, dict):
            raise MessageError(f"{cls.__name__}: expected a map")
        if data.get("kind") != cls.KIND:
            raise MessageError(f"expected a {cls.KIND!r} message, got {data.get('kind')!r}")
        v = data.get("v")
        if type(v) is not int or not 1 <= v <= SCHEMA_VERSION:
            raise MessageError(f"{cls.KIND}: unsupported schema version {data.get('v')!r}")
        return cls.from_dict(data)


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder()


def _field_path(cls: type, error: str) -> str:
    """msgspec's "<what> - at `$.sampling.max_tokens`" as "PrefillSubmit.sampling.max_tokens: <what>", and its
    "missing required field `x`" naming the field as 'x'."""
    what, sep, where = error.rpartition(" - at `$")
    if sep:
        return f"{cls.__name__}{where.rstrip('`')}: {what}"
    return f"{cls.__name__}: " + error.replace("field `", "field '").replace("`", "'")


def message(kind: str):
    """Class decorator: registers a Message subclass under `kind`."""
    def wrap(cls):
        cls.KIND = kind
        cls.PACKED = _packed_fields(cls)
        KINDS[kind] = cls
        return cls
    return wrap


KINDS: dict[str, type[Message]] = {}


# ---- admission (router <-> gate) ---------------------------------------------------------------
@message("admit")
class AdmitRequest(Message):
    request_id: str
    prompt_tokens: int
    max_tokens: int
    decode_instance: str | None = None  # None: the gate picks the decode with the least committed KV
    router_boot: str = ""  # the admitting router process (its load reports' detail["boot"]): when that router
    #                        instance reports another boot (it was restarted), the gate drops what this one held
    priority: int = 0      # agent hint, higher first: a head start of priority x gate.priority_step_s in the queue
    latency_s: float = 0.0  # agent hint (latency_sensitivity): seconds more of head start
    osl: int = 0           # agent hint: expected output tokens (0: unknown); the gate reserves min(max_tokens, osl x osl_margin)
    prefer_decode: str = ""  # the decode that served the session's last turn (holds its blocks): taken when it has room now


@message("admit_reply")
class AdmitReply(Message):
    request_id: str
    status: str  # "admitted" | "rejected" (over budget after waiting: 429) | "unavailable" (no live decode can
    #              take it: 503) | "invalid" (can never fit: 400)
    decode_instance: str | None = None
    reason: str = ""
    retry_after_s: float = 0.0
    waited_ms: float = 0.0


@message("release")
class Release(Message):
    request_id: str
    reason: str = ""


@message("holdings")
class Holdings(Message):
    """A router's periodic list of the requests it may still hold gate budget for (admitted, or asked and
    not yet released). The gate drops what this router process (`boot`) holds that is not listed and is
    older than its grace: a Release lost with the bus (nats-server killed or restarted) frees its budget.
    Prefill and decode end what this router instance sent them and no longer lists (shared/holdings.py)."""
    router: str
    boot: str
    request_ids: list[str]


# ---- prefill submission and the KV handoff (router -> prefill -> decode) -------------------------
@message("prefill_submit")
class PrefillSubmit(Message):
    request_id: str
    prompt_ids: TokenIds
    sampling: SamplingParams
    decode_instance: str  # "": not admitted yet (overlapped admission): a DecodeAssign or a Cancel follows
    session_id: str | None = None
    tenant: str = ""  # salts the request's KV namespace (device cache, pool keys): "" = the deployment's own
    router: str = ""  # the sending router instance: its Holdings tell when nobody waits for the request
    priority: int = 0  # agent hint, higher first: weighs the prompt's place in prefill's srpf order
    retain: bool = False  # a SessionTurn will say how this turn ended: the pool save waits for it to pin or not


@message("decode_assign")
class DecodeAssign(Message):
    """The router tells the prefill of a request it submitted before the gate's answer (PrefillSubmit with no
    decode_instance) which decode instance the gate admitted it to. A refusal comes as a Cancel instead."""
    request_id: str
    decode_instance: str


@message("ack")
class Ack(Message):
    request_id: str
    ok: bool
    error: str = ""
    stats: dict = msgspec.field(default_factory=dict)  # e.g. decode's scatter time, for the handoff span


@message("slot_request")
class SlotRequest(Message):
    """Prefill asks a decode instance for landing slots for one request's KV."""
    request_id: str
    prefill_instance: str
    total_bytes: int
    num_tokens: int
    max_slots: int
    ask: int = 0  # this handoff's n-th ask (from 1): asked again after a bus timeout, decode answers the same n with
                  # the same slots instead of lending more (0: no such promise)
    block_hashes: list = msgspec.field(default_factory=list)  # as PagesRequest's (decode reuse): the leading blocks
    block_size: int = 0  # of prefill's blocks, which those hashes chain: decode matches them only if its own is
    #   the same


@message("slot_grant")
class SlotGrant(Message):
    request_id: str
    endpoint: str = ""                                # decode's transfer-engine endpoint
    slots: list = msgspec.field(default_factory=list)         # [[slot_id, addr, nbytes], ...]
    reused_tokens: int = 0  # leading tokens decode already holds (SlotRequest.block_hashes): prefill sends only the
    #   bytes of the tokens after them; the same in every grant of the request
    error: str = ""
    fatal: bool = False  # asking again cannot help (cancelled, layout mismatch, malformed); else: no room yet, ask again


@message("slots_filled")
class SlotsFilled(Message):
    """Prefill wrote these slots: bytes [offset, offset + nbytes) of the request's rank buffer."""
    request_id: str
    pieces: list                                      # [[slot_id, offset, nbytes], ...]
    crcs: list = msgspec.field(default_factory=list)          # CRC-32C of each piece's bytes, in pieces' order
    #   (shared/handoff_check.py). Optional on the wire so older messages still decode, but every sender
    #   fills it and decode refuses pieces without one: the request fails (503), unverified bytes never land.


@message("pages_request")
class PagesRequest(Message):
    """Prefill asks a decode instance for KV blocks to write one request's KV straight into (the direct
    handoff, services/prefill/direct.py). `block_layout` is the layout of one block's bytes
    (KVLayout.block_layout): decode grants only when its own is the same."""
    request_id: str
    prefill_instance: str
    num_tokens: int
    block_layout: list
    block_hashes: list = msgspec.field(default_factory=list)  # the prompt's full blocks' chained hashes (its tenant's
    #   namespace): decode grants the leading ones it still holds as `reused` and prefill writes only the rest


@message("pages_grant")
class PagesGrant(Message):
    request_id: str
    endpoint: str = ""                                # decode's transfer-engine endpoint
    runs: list = msgspec.field(default_factory=list)          # the request's blocks, in order: [[addr, count], ...] of
    #   `count` consecutive blocks from address `addr`
    block_bytes: int = 0                              # bytes of one block (all layers, K and V)
    reused: int = 0                                   # leading blocks decode already holds (PagesRequest.block_hashes):
    #   `runs` are the request's other blocks, from block `reused` on, and prefill writes only those
    error: str = ""
    fatal: bool = False        # asking again cannot help (cancelled, malformed); else: no room yet, ask again
    unsupported: bool = False  # this decode takes no direct writes (layout differs, turned off): use slots


@message("pages_released")
class PagesReleased(Message):
    """Prefill will write nothing more into the blocks granted for this request (its handoff failed or was
    cancelled after the grant): decode may give them to another request now."""
    request_id: str


@message("pages_landed")
class PagesLanded(Message):
    """Some of a direct handoff's writes are complete in decode's pages (its Transfer Engine said so while
    the others are still on the wire): decode may verify these now, beside the rest of the write. Only a
    head start: HandoffDone still lists every write, and decode checks whatever it has not checked yet."""
    request_id: str
    pages: list = msgspec.field(default_factory=list)          # [[first, count, offset, nbytes, crc32c]], as HandoffDone.pages


@message("handoff_done")
class HandoffDone(Message):
    """All KV landed: decode adopts the request and continues generating."""
    request_id: str
    prompt_ids: TokenIds
    output_ids: TokenIds
    shown_text: str
    sampling: SamplingParams
    token_sources: dict                                # {"device": n, "store": n, "computed": n}
    handoff: dict = msgspec.field(default_factory=dict)        # bytes, writes, gather/write ms (for the trace)
    router: str = ""                                   # the router instance the request came from (its Holdings)
    priority: int = 0                                  # agent hint, higher first: decode preempts lower priorities first
    tenant: str = ""                                   # the KV namespace its blocks are indexed under (decode reuse)
    session_id: str = ""                               # decode frees the blocks it keeps for it when the session is closed
    pages: list = msgspec.field(default_factory=list)          # direct handoff: [[first, count, offset, nbytes, crc32c]]
    #   per write (byte range [offset, offset + nbytes) of the granted blocks first..first+count-1, which
    #   are consecutive in decode's pages); empty: the KV came through landing slots (SlotsFilled)


# ---- tokens, cancellation, load ----------------------------------------------------------------
@message("tokens")
class TokenChunk(Message):
    request_id: str
    token_ids: TokenIds
    text: str
    finished: bool = False
    finish_reason: str | None = None
    usage: dict | None = None   # on the final chunk
    error: dict | None = None   # {"status": int, "type": str, "message": str}
    logprobs: list[TokenLogprob] | None = None  # one per token_ids entry, when the request asked (SamplingParams)


@message("cancel")
class Cancel(Message):
    request_id: str
    reason: str = ""


@message("session_close")
class SessionClose(Message):
    """A client closed a session (DELETE /v1/sessions/{id}, or nvext.session_control on its last request):
    every prefill frees the KV only that session used, on its device and in the pool."""
    session_id: str
    tenant: str = ""


@message("session_turn")
class SessionTurn(Message):
    """A session's turn ended with an answer (200). `expected_back`: it ended in a tool call (OpenAI
    `tool_calls`, Anthropic `tool_use`, a Responses `function_call`): the agent runs the tool and returns with
    the whole history. Otherwise the answer ended the task: the KV only this session holds (shared/sessions.py)
    moves to the old end of the prefix caches' LRU on every prefill and decode, to be evicted before the
    KV of sessions that are expected back. Prefill's pool saves of the turn (PrefillSubmit.retain) soft-pin
    their objects for `pin_s` when it comes back, and leave them unpinned when it ended."""
    session_id: str
    tenant: str = ""
    expected_back: bool = False
    pin_s: float = 0.0  # expected back: soft-pin its new pool objects this long (router's TTL); prefetch looks until
    expect_in_s: float = 0.0  # expected back: agents' median tool pause so far (0: too few seen); times a prefetch


@message("load")
class LoadReport(Message):
    instance: str
    role: str                    # router | gate | prefill | decode
    ready: bool
    capacity_tokens: int = 0     # KV capacity (prefill/decode)
    free_tokens: int = 0         # KV not held by any request
    running: int = 0
    waiting: int = 0
    queued_tokens: int = 0       # prompt tokens not yet computed (prefill)
    endpoint: str = ""
    detail: dict = msgspec.field(default_factory=dict)
    boot: str = ""               # this process's incarnation (the runtime fills it in): a new one = restarted


@message("exited")
class InstanceExited(Message):
    """A service process ended, announced by whoever saw it end: `moorage up`'s supervisor (at once, from
    waitpid), systemd's ExecStopPost (`moorage exited`), or `moorage watch` (compose). Busy is not dead:
    this, not a silent load report, is how routers, gates and engines learn that an instance is gone.
    A receiver acts only when `boot` is the incarnation it last heard from that instance (or it knows
    none): a late announcement never ends a restarted process's work."""
    role: str
    instance: str
    boot: str = ""            # the process incarnation that ended (its load reports' `boot`); "" = unknown
    how: str = ""             # e.g. "killed by SIGKILL", "exit code 1"
    clean: bool = False       # it stopped on request and exited 0 (it said goodbye itself)
    pid: int = 0
    source: str = ""          # moorage-up | systemd | watch


@message("kv_events")
class KVEventBatch(Message):
    instance: str
    events: list                 # [{"type": "stored"|"removed"|"cleared", "hashes": [...], "medium": ...}]


def decode_any(raw: bytes) -> Message:
    """Decode by the message's own kind (for tools that watch several subjects)."""
    try:
        kind = _DECODER.decode(raw).get("kind")
    except Exception as e:
        raise MessageError(f"not a moorage message: {e}") from None
    if not isinstance(kind, str) or kind not in KINDS:
        raise MessageError(f"unknown message kind {kind!r}")
    return KINDS[kind].decode(raw)


def request_id_of(raw: bytes) -> str:
    """A message's request_id, best effort, for answering one that failed to decode ("" when none)."""
    try:
        rid = _DECODER.decode(raw).get("request_id")
    except Exception:
        return ""
    return rid if isinstance(rid, str) else ""


def make_usage(prompt_tokens: int, completion_tokens: int, sources: dict) -> dict:
    """The final chunk's usage: OpenAI fields plus moorage's token sources (they sum to the prompt)."""
    device, store = int(sources.get("device", 0)), int(sources.get("store", 0))
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": device + store},
        "moorage": {"device": device, "store": store, "computed": prompt_tokens - device - store},
    }


def error_info(status: int, message: str, type_: str = "server_error") -> dict:
    return {"status": status, "type": type_, "message": message}


def kv_event_dict(event) -> dict:
    """A shared.kv_events event as it travels in KVEventBatch (token ids stay home: routers need hashes)."""
    kind = {"BlockStored": "stored", "BlockRemoved": "removed", "AllBlocksCleared": "cleared"}[type(event).__name__]
    return {"type": kind, "hashes": list(getattr(event, "block_hashes", [])), "medium": event.medium}


# ---- the stores' disk tier (services/store/disk.py) -----------------------------------------------
@message("disk_spill")
class DiskSpill(Message):
    """A prefill saved these pool objects: stores with a disk tier copy the ones in their own segment to disk
    (keys only: the bytes move through Mooncake)."""
    keys: list[str]
    sizes: list[int]


@message("disk_drop")
class DiskDrop(Message):
    """These pool objects will not be asked for again (their session was closed): stores delete their disk copies."""
    keys: list[str]


@message("disk_index")
class DiskIndex(Message):
    """A store's disk tier changed: these keys were written (`added`) or deleted (`removed`). `snapshot`: the
    whole listing (replaces what the receiver knew of this store), sent at start and when asked."""
    store: str
    added: list[str] = msgspec.field(default_factory=list)
    removed: list[str] = msgspec.field(default_factory=list)
    snapshot: bool = False


@message("disk_sync")
class DiskSync(Message):
    """Asks every store with a disk tier for its snapshot (a prefill that just started)."""
    instance: str


@message("disk_load")
class DiskLoad(Message):
    """Asks a store to put these objects back into the pool from its disk, in order (chunk-major, every stage
    of a chunk): the reply says how many leading keys are in the pool now. `replace`: the pool lists these keys but
    could not serve them (their store died, its segment not yet dropped): remove them before putting."""
    keys: list[str]
    replace: bool = False


@message("disk_loaded")
class DiskLoaded(Message):
    loaded: int               # leading keys of the request now in the pool
    reason: str = ""          # why the next one is not ("" when all are)

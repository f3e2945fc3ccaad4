"""shared/messages.py: every kind round-trips; decoding tolerates unknown fields and rejects everything else
with a MessageError that says what is wrong."""

from __future__ import annotations

import msgpack
import msgspec
import pytest

from shared import messages as m
from shared.engine.sampling import SamplingParams
from shared.messages import KINDS, SCHEMA_VERSION, MessageError, decode_any, error_info, make_usage

SAMPLING = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=16, stop=("\n",), seed=3)

SAMPLES: dict[str, m.Message] = {
    "admit": m.AdmitRequest("r1", prompt_tokens=120, max_tokens=64, decode_instance="decode-0"),
    "admit_reply": m.AdmitReply("r1", "rejected", decode_instance=None, reason="over budget", retry_after_s=1.5,
                                waited_ms=30.25),
    "release": m.Release("r1", reason="finished"),
    "session_close": m.SessionClose("s-9", tenant="acme"),
    "session_turn": m.SessionTurn("s-9", tenant="acme", expected_back=True),
    "holdings": m.Holdings("router-0", "boot-a", ["r1", "r2"]),
    "prefill_submit": m.PrefillSubmit("r1", [1, 2, 3, 70000], SAMPLING, "decode-1", session_id="s-9", tenant="acme"),
    "decode_assign": m.DecodeAssign("r1", "decode-1"),
    "ack": m.Ack("r1", ok=False, error="no slots", stats={"scatter_ms": 1.25, "pieces": 3}),
    "slot_request": m.SlotRequest("r1", "prefill-0", total_bytes=1 << 33, num_tokens=4096, max_slots=4),
    "slot_grant": m.SlotGrant("r1", endpoint="10.0.0.2:12345", slots=[[0, 1 << 40, 4096], [1, 2 << 40, 4096]]),
    "slots_filled": m.SlotsFilled("r1", pieces=[[0, 0, 4096], [1, 4096, 100]]),
    "handoff_done": m.HandoffDone("r1", [1, 2, 3], [4], "héllo ✓", SAMPLING,
                                  {"device": 1, "store": 1, "computed": 1}, handoff={"bytes": 8192, "writes": 2},
                                  pages=[[0, 2, 0, 1 << 20, 0xDEADBEEF]]),
    "pages_request": m.PagesRequest("r1", "prefill-0", 40, [30, 3, 64, "torch.float32", 16]),
    "pages_grant": m.PagesGrant("r1", "10.0.0.2:12345", runs=[[1 << 40, 3], [2 << 40, 1]], block_bytes=737280),
    "pages_released": m.PagesReleased("r1"),
    "pages_landed": m.PagesLanded("r1", pages=[[0, 2, 0, 1 << 20, 0xDEADBEEF]]),
    "tokens": m.TokenChunk("r1", [5, 6], " world", finished=True, finish_reason="stop",
                           usage=make_usage(3, 2, {"device": 1}), error=None),
    "cancel": m.Cancel("r1", reason="client disconnected"),
    "exited": m.InstanceExited("decode", "decode-0", boot="3f2a9c01b7de", how="killed by SIGKILL", pid=4242,
                               source="moorage-up"),
    "load": m.LoadReport("decode-0", "decode", True, capacity_tokens=16384, free_tokens=1000, running=2,
                         waiting=1, queued_tokens=0, endpoint="10.0.0.2:1", detail={"committed": 500}),
    "kv_events": m.KVEventBatch("prefill-0", [{"type": "stored", "hashes": [1, 2**63], "medium": "device"},
                                              {"type": "cleared"}]),
    "disk_spill": m.DiskSpill(["t/s0of2/ab", "t/s1of2/ab"], [4224, 4224]),
    "disk_drop": m.DiskDrop(["t/s0of2/ab", "t/s1of2/ab"]),
    "disk_index": m.DiskIndex("store-0", added=["t/s0of2/ab"], removed=["t/s1of2/cd"], snapshot=True),
    "disk_sync": m.DiskSync("prefill-0"),
    "disk_load": m.DiskLoad(["t/s0of2/ab", "t/s1of2/ab"]),
    "disk_loaded": m.DiskLoaded(1, reason="t/s1of2/ab: payload checksum mismatch"),
}


def raw_of(msg: m.Message, **changes) -> dict:
    data = msgpack.unpackb(msg.encode(), raw=False)
    data.update(changes)
    return data


def pack(data) -> bytes:
    return msgpack.packb(data, use_bin_type=True)


def test_samples_cover_every_kind():
    assert set(SAMPLES) == set(KINDS)
    for kind, msg in SAMPLES.items():
        assert type(msg) is KINDS[kind] and msg.KIND == kind


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_round_trip(kind):
    msg = SAMPLES[kind]
    raw = msg.encode()
    assert isinstance(raw, bytes)
    assert type(msg).decode(raw) == msg
    assert decode_any(raw) == msg
    data = msgpack.unpackb(raw, raw=False)
    assert data["kind"] == kind and data["v"] == SCHEMA_VERSION


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_defaults_round_trip(kind):
    """Only the required fields given: the defaults survive too (and default containers are not shared)."""
    cls = KINDS[kind]
    full = SAMPLES[kind]
    required = {f.name: getattr(full, f.name) for f in msgspec.structs.fields(cls) if f.required}
    msg = cls(**required)
    assert cls.decode(msg.encode()) == msg


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_unknown_fields_are_tolerated(kind):
    msg = SAMPLES[kind]
    raw = pack(raw_of(msg, added_by_newer_sender={"x": 1}, another=[1, 2]))
    assert type(msg).decode(raw) == msg
    assert decode_any(raw) == msg


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_missing_required_field_is_named(kind):
    cls = KINDS[kind]
    required = [f.name for f in msgspec.structs.fields(cls) if f.required]
    assert required
    for name in required:
        data = raw_of(SAMPLES[kind])
        del data[name]
        with pytest.raises(MessageError, match=repr(name)):
            cls.decode(pack(data))


@pytest.mark.parametrize("cls, field, value", [
    (m.AdmitRequest, "prompt_tokens", "x"),
    (m.AdmitRequest, "prompt_tokens", 1.5),
    (m.AdmitRequest, "prompt_tokens", True),       # a bool is not an int here
    (m.AdmitRequest, "request_id", 7),
    (m.AdmitRequest, "request_id", None),          # required fields must not be null
    (m.AdmitRequest, "decode_instance", 3),        # optional, but still typed
    (m.PrefillSubmit, "prompt_ids", 5),
    (m.PrefillSubmit, "prompt_ids", "1,2,3"),
    (m.PrefillSubmit, "sampling", [1]),
    (m.Ack, "ok", 1),
    (m.Ack, "stats", None),
    (m.AdmitReply, "retry_after_s", "soon"),
    (m.TokenChunk, "usage", [1]),
    (m.TokenChunk, "finished", "yes"),
    (m.LoadReport, "ready", None),
    (m.KVEventBatch, "events", {"type": "stored"}),
])
def test_wrong_primitive_type(cls, field, value):
    data = raw_of(SAMPLES[cls.KIND], **{field: value})
    with pytest.raises(MessageError, match=f"{cls.__name__}.{field}"):
        cls.decode(pack(data))


def test_lenient_numeric_types():
    """An int where a float is declared is fine, and a tuple is a list (msgpack has one array type)."""
    msg = m.AdmitReply.decode(pack(raw_of(SAMPLES["admit_reply"], retry_after_s=2)))
    assert msg.retry_after_s == 2
    assert m.PrefillSubmit.decode(pack(raw_of(SAMPLES["prefill_submit"], prompt_ids=(1, 2)))).prompt_ids == [1, 2]
    # optional fields accept null
    assert m.TokenChunk.decode(pack(raw_of(SAMPLES["tokens"], usage=None, finish_reason=None))).usage is None


def test_wrong_kind():
    raw = SAMPLES["admit"].encode()
    with pytest.raises(MessageError, match="'release'.*'admit'"):
        m.Release.decode(raw)
    with pytest.raises(MessageError, match="None"):
        m.AdmitRequest.decode(pack({k: v for k, v in raw_of(SAMPLES["admit"]).items() if k != "kind"}))


def test_newer_or_bad_schema_version():
    for v in (SCHEMA_VERSION + 1, "1", None, 1.0):
        with pytest.raises(MessageError, match="schema version"):
            m.AdmitRequest.decode(pack(raw_of(SAMPLES["admit"], v=v)))
    data = raw_of(SAMPLES["admit"])
    del data["v"]
    with pytest.raises(MessageError, match="schema version"):
        m.AdmitRequest.decode(pack(data))
    with pytest.raises(MessageError, match="schema version"):
        decode_any(pack(raw_of(SAMPLES["admit"], v=SCHEMA_VERSION + 1)))


@pytest.mark.parametrize("raw", [b"", b"\xc1", b"not msgpack at all \xff\xfe", pack([1, 2]), pack("admit"), pack(3),
                                 SAMPLES["cancel"].encode() + b"\x00", SAMPLES["cancel"].encode()[:-3]])
def test_garbage_bytes(raw):
    with pytest.raises(MessageError):
        m.Cancel.decode(raw)
    with pytest.raises(MessageError):
        decode_any(raw)


def test_decode_any_dispatches_by_kind():
    for kind, msg in SAMPLES.items():
        out = decode_any(msg.encode())
        assert type(out) is KINDS[kind] and out == msg
    with pytest.raises(MessageError, match="unknown message kind 'nope'"):
        decode_any(pack({"v": 1, "kind": "nope"}))
    with pytest.raises(MessageError, match="unknown message kind None"):
        decode_any(pack({"v": 1, "request_id": "r"}))
    with pytest.raises(MessageError, match="missing required field 'token_ids'"):
        decode_any(pack({"v": 1, "kind": "tokens", "request_id": "r", "text": ""}))


def test_decode_any_unhashable_kind():
    with pytest.raises(MessageError):
        decode_any(pack({"v": 1, "kind": ["admit"]}))


def test_make_usage_sums():
    for prompt, completion, sources in [(100, 7, {"device": 60, "store": 30, "computed": 10}),
                                        (10, 0, {}), (5, 1, {"store": 5}), (8, 2, {"device": "3"})]:
        u = make_usage(prompt, completion, sources)
        mo = u["moorage"]
        assert mo["device"] + mo["store"] + mo["computed"] == prompt == u["prompt_tokens"]
        assert u["prompt_tokens_details"]["cached_tokens"] == mo["device"] + mo["store"]
        assert u["completion_tokens"] == completion and u["total_tokens"] == prompt + completion
        assert all(isinstance(v, int) for v in mo.values())
    assert make_usage(100, 7, {"device": 60, "store": 30})["moorage"]["computed"] == 10


def test_error_info_rides_a_token_chunk():
    chunk = m.TokenChunk("r1", [], "", finished=True, finish_reason="error", error=error_info(429, "busy", "rate"))
    assert m.TokenChunk.decode(chunk.encode()).error == {"status": 429, "type": "rate", "message": "busy"}


# ---- packed token ids ---------------------------------------------------------------------------
PACKED = [(m.PrefillSubmit, "prompt_ids"), (m.HandoffDone, "prompt_ids"), (m.HandoffDone, "output_ids"),
          (m.TokenChunk, "token_ids")]


def test_every_token_id_list_is_packed():
    """Every list of token ids on the bus is declared TokenIds (and nothing else is)."""
    declared = {(cls, name) for cls in KINDS.values() for name in cls.PACKED}
    assert declared == set(PACKED)


@pytest.mark.parametrize("cls, field", PACKED)
def test_token_ids_travel_as_little_endian_uint32(cls, field):
    ids = [0, 1, 255, 256, 65535, 65536, 2**32 - 1]
    msg = msgspec.structs.replace(SAMPLES[cls.KIND], **{field: ids})
    wire = msgpack.unpackb(msg.encode(), raw=False)[field]
    assert isinstance(wire, bytes) and wire == b"".join(i.to_bytes(4, "little") for i in ids)
    out = cls.decode(msg.encode())
    assert getattr(out, field) == ids and all(type(t) is int for t in getattr(out, field))


def test_a_million_ids_round_trip_in_four_bytes_each():
    ids = [(i * 2654435761) % 200_000 for i in range(1_000_000)]  # a 200K vocabulary, all over it
    msg = m.PrefillSubmit("big", ids, SAMPLING, "decode-0", tenant="t")
    raw = msg.encode()
    assert 4_000_000 < len(raw) < 4_000_000 + 512
    assert m.PrefillSubmit.decode(raw) == msg
    done = m.HandoffDone("big", ids, [7], "x", SAMPLING, {"computed": len(ids)})
    assert m.HandoffDone.decode(done.encode()).prompt_ids == ids


@pytest.mark.parametrize("ids", [[-1], [2**32], [1.5], [True], ["1"], [[1, 2]], [2**70]])
def test_unpackable_ids_are_refused_at_encode(ids):
    with pytest.raises(MessageError, match="token ids"):
        m.PrefillSubmit("r", ids, SAMPLING, "decode-0").encode()


def test_packed_ids_of_a_wrong_length_are_refused():
    data = raw_of(SAMPLES["prefill_submit"], prompt_ids=b"\x01\x00\x00")
    with pytest.raises(MessageError, match="multiple of 4"):
        m.PrefillSubmit.decode(pack(data))


def test_a_plain_list_of_ids_is_still_accepted():
    """An older sender's unpacked list decodes the same."""
    data = raw_of(SAMPLES["prefill_submit"], prompt_ids=[1, 2, 70000])
    assert m.PrefillSubmit.decode(pack(data)).prompt_ids == [1, 2, 70000]
    assert m.PrefillSubmit.decode(pack(raw_of(SAMPLES["prefill_submit"], prompt_ids=b""))).prompt_ids == []


def test_tenant_defaults_to_the_deployment_namespace():
    data = raw_of(SAMPLES["prefill_submit"])
    del data["tenant"]
    assert m.PrefillSubmit.decode(pack(data)).tenant == ""
    assert m.PrefillSubmit.decode(SAMPLES["prefill_submit"].encode()).tenant == "acme"


# ---- the typed sampling contract ------------------------------------------------------------------
@pytest.mark.parametrize("cls", [m.PrefillSubmit, m.HandoffDone])
@pytest.mark.parametrize("change, says", [
    ({"max_tokens": 0}, "max_tokens must be a positive integer"),
    ({"max_tokens": True}, "Expected `int`, got `bool`"),
    ({"temperature": "hot"}, "Expected `float`, got `str`"),
    ({"top_p": 2.0}, "top_p must be in"),
    ({"stop": ["x"] * 17}, "at most 16 stop sequences"),
    ({"grammar": "start: x", "ignore_eos": True}, "ignore_eos cannot be set"),
    ({"best_of": 3}, "unknown field `best_of`"),
])
def test_sampling_is_checked_by_its_own_type_on_every_decode(cls, change, says):
    """Prefill and decode take the router's SamplingParams back off the bus only through SamplingParams'
    own checks: a bad value or a field this version does not know is a MessageError naming the path."""
    data = raw_of(SAMPLES[cls.KIND])
    data["sampling"] = {**data["sampling"], **change}
    with pytest.raises(MessageError, match=f"{cls.__name__}.sampling") as err:
        cls.decode(pack(data))
    assert says in str(err.value)


def test_sampling_arrives_as_the_struct_the_router_built():
    out = m.PrefillSubmit.decode(SAMPLES["prefill_submit"].encode())
    assert type(out.sampling) is SamplingParams and out.sampling == SAMPLING
    assert out.sampling.stop == ("\n",) and hash(out.sampling) == hash(SAMPLING)
    greedy = m.PrefillSubmit.decode(msgspec.structs.replace(
        SAMPLES["prefill_submit"], sampling=SamplingParams(temperature=1e-9)).encode())
    assert greedy.sampling.greedy and greedy.sampling.temperature == 0.0  # normalised on the way in too


def test_request_id_of_a_message_that_failed_to_decode():
    """What a service answers a malformed request with (the gate's AdmitReply names it)."""
    bad = raw_of(SAMPLES["admit"], prompt_tokens="many")
    with pytest.raises(MessageError):
        m.AdmitRequest.decode(pack(bad))
    assert m.request_id_of(pack(bad)) == "r1"
    assert m.request_id_of(b"\xc1") == "" and m.request_id_of(pack([1])) == ""
    assert m.request_id_of(pack({"request_id": 7})) == ""

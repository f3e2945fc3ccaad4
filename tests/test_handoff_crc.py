"""Checksummed KV handoffs (issue 11, item 3): bytes corrupted between prefill's write and decode's
adoption fail that request cleanly (a retry or a 503), never turn into tokens, and leave decode idle.

From the inside out:
- pure: the checksum, SlotsFilled's pieces + crcs, verify's reasons, the fault hook's switch;
- the message codec (old SlotsFilled without crcs still decodes, and decode refuses it);
- decode's LandingZone with a real tiny engine: a corrupted slot frees the landing's KV and slots (also
  with its pages treated as foreign, `transfer.register_pages` false);
- in process, real Transfer Engines over loopback and a real nats-server: prefill's HandoffSender writes
  into decode's landing slots and the test corrupts one in flight with a second Transfer Engine write of
  its own, after prefill's write and before decode's check; then a clean handoff is adopted and its
  tokens equal the reference; also with `transfer.register_pages` false (KV gathered and scattered through a
  scratch buffer, as from a GPU's pages: shared/device_staging.py);
- the whole system (router, gate, prefill, decode processes), decode started with
  MOORAGE_FAULT_CORRUPT_LANDING: non-streamed requests are retried (then 503), a stream that already
  sent its first token ends with an error event, and every token that reached a client is right.
"""

from __future__ import annotations

import asyncio
import ctypes
import json

import crc32c
import httpx
import msgpack
import pytest
import torch

from services.decode.landing import LandingZone
from services.prefill.handoff import HandoffFailed
from shared.engine.engine import Engine, EngineConfig
from shared.engine.sampling import SamplingParams
from shared.handoff_check import (FAULT_ENV, MISMATCH, UNVERIFIED, HandoffChecks, LandingFaults, Piece,
                                  Unverified, checksum, parse, to_wire, verify)
from shared.messages import HandoffDone, SlotRequest, SlotsFilled
from shared.transfer import KVTransport, TransferConfig
from tests.decode_zone import collect_chunks, handoff_pair, running_decode

NUM_BLOCKS = 32


# ---------------------------------------------------------------- pure


def _u8(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def test_checksum_is_crc32c_of_the_bytes_whatever_the_dtype():
    assert checksum(_u8(b"123456789")) == 0xE3069283  # the CRC-32C check value
    assert checksum(torch.empty(0, dtype=torch.uint8)) == 0
    kv = torch.randn(256, dtype=torch.float32).to(torch.bfloat16)  # numpy has no bfloat16: read as bytes
    assert checksum(kv) == crc32c.crc32c(kv.view(torch.uint8).numpy().tobytes())
    assert checksum(kv.view(16, 16)) == checksum(kv)
    with pytest.raises(ValueError):
        checksum(torch.zeros(4, 4, dtype=torch.uint8).t())  # not contiguous


def test_pieces_need_exactly_one_checksum_each():
    pieces = [Piece(0, 0, 4096, 7), Piece(3, 4096, 100, 0xFFFFFFFF)]
    wire, crcs = to_wire(pieces)
    assert wire == [[0, 0, 4096], [3, 4096, 100]] and crcs == [7, 0xFFFFFFFF]
    assert parse(wire, crcs) == pieces
    assert parse([], []) == []
    with pytest.raises(Unverified, match="without checksums"):
        parse(wire, [])
    for bad_pieces, bad_crcs in [(wire, [7]), (wire, [7, 1 << 32]), (wire, [7, -1]), (wire, [7, "x"]),
                                 ([[0, 0]], [1]), ([[0, -1, 5]], [1]), ([[0, 0, True]], [1]), ([7], [1])]:
        with pytest.raises(ValueError) as e:
            parse(bad_pieces, bad_crcs)
        assert e.type is ValueError  # malformed, not "unverified"


def test_verify_returns_why_not():
    data = _u8(bytes(range(256)) * 16)
    piece = Piece(2, 8192, data.numel(), checksum(data))
    assert verify(data, piece) is None
    assert verify(data[:-1], piece) == f"size {data.numel() - 1} != {data.numel()}"
    data[1000] ^= 1  # one bit
    reason = verify(data, piece)
    assert reason.startswith(MISMATCH) and "slot 2" in reason and "[8192, 12288)" in reason


def test_the_fault_hook_is_off_unless_set(monkeypatch):
    monkeypatch.delenv(FAULT_ENV, raising=False)
    assert LandingFaults.from_env().corrupt_pieces == 0
    monkeypatch.setenv(FAULT_ENV, "3")
    faults = LandingFaults.from_env()
    assert faults.corrupt_pieces == 3
    monkeypatch.setenv(FAULT_ENV, "yes")
    with pytest.raises(ValueError, match=FAULT_ENV):
        LandingFaults.from_env()
    buf = _u8(bytes(8))
    assert [faults.apply(buf) for _ in range(4)] == [True, True, True, False]
    assert buf[4].item() == 0x5A  # flipped three times at the same byte: 0 ^ 0x5A ^ 0x5A ^ 0x5A


def test_checks_report_under_stable_names():
    assert HandoffChecks(5, 1, 2).detail() == {"handoff_crc_verified": 5, "handoff_crc_failures": 1,
                                               "handoff_crc_unverified": 2}


# ---------------------------------------------------------------- codec


def test_slots_filled_carries_crcs_and_an_older_message_still_decodes():
    msg = SlotsFilled("r1", [[0, 0, 4096], [1, 4096, 100]], [0xDEADBEEF, 0])
    assert SlotsFilled.decode(msg.encode()) == msg
    old = msgpack.packb({"v": 1, "kind": "slots_filled", "request_id": "r1", "pieces": [[0, 0, 4096]]})
    decoded = SlotsFilled.decode(old)
    assert decoded.pieces == [[0, 0, 4096]] and decoded.crcs == []  # decodes; decode then refuses it
    with pytest.raises(ValueError):
        SlotsFilled.decode(msgpack.packb({"v": 1, "kind": "slots_filled", "request_id": "r1",
                                          "pieces": [], "crcs": "deadbeef"}))


# ---------------------------------------------------------------- LandingZone, real tiny engine


@pytest.fixture
def engine(tiny):
    return Engine(tiny, EngineConfig(num_blocks=NUM_BLOCKS))


@pytest.fixture(params=[pytest.param(True, id="registered"), pytest.param(False, id="foreign")])
async def decode(engine, request):
    """A decode whose scatters go straight into its pages, or (foreign) through a scratch buffer."""
    async with running_decode(engine, register_pages=request.param) as svc:
        assert svc.zone.copies.foreign == (not request.param)
        yield svc


def _fill(zone: LandingZone, slot_id: int, nbytes: int, seed: int) -> torch.Tensor:
    view = zone.slots.view(slot_id, nbytes)
    view.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))
    return view


async def _idle(zone: LandingZone, engine: Engine) -> bool:
    free = await zone.loop.call(lambda: engine.block_manager.num_free_blocks)
    return not zone.landings and zone.slots.num_free == zone.slots.num_slots and free == NUM_BLOCKS


async def test_a_verified_slot_is_scattered_and_counted(decode, engine):
    zone = decode.zone
    reply = await zone.grant(SlotRequest("r1", "prefill-0", 40 * zone.token_bytes, 40, max_slots=1))
    slot_id, n = reply.slots[0][0], 40 * zone.token_bytes
    crc = checksum(_fill(zone, slot_id, n, seed=1))
    ack = await zone.filled(SlotsFilled("r1", [[slot_id, 0, n]], [crc]))
    assert ack.ok and ack.stats["verify_ms"] >= 0 and zone.checks == HandoffChecks(verified=1)
    assert zone.landings["r1"].received_bytes == n
    await zone.drop("r1")
    assert await _idle(zone, engine)


async def test_a_corrupted_slot_fails_its_request_and_frees_its_kv_and_slots(decode, engine):
    zone = decode.zone
    B = zone.layout.block_size
    tokens = 3 * B
    reply = await zone.grant(SlotRequest("r1", "prefill-0", tokens * zone.token_bytes, tokens, max_slots=3))
    assert len(reply.slots) == 3 and engine.block_manager.num_free_blocks == NUM_BLOCKS - 3
    n = B * zone.token_bytes  # three pieces of one block each; the second is corrupted after its crc
    pieces = [[s[0], i * n, n] for i, s in enumerate(reply.slots)]
    crcs = [checksum(_fill(zone, s, n, seed=i)) for i, (s, _, _) in enumerate(pieces)]
    zone.slots.view(pieces[1][0], n)[n - 1] ^= 0x01
    ack = await zone.filled(SlotsFilled("r1", pieces, crcs))
    assert not ack.ok and ack.error == MISMATCH
    assert zone.checks == HandoffChecks(verified=1, failures=1)  # the first scattered, the second refused
    assert await _idle(zone, engine)  # the first piece's scattered blocks went back too
    assert zone.is_cancelled("r1")
    late = await zone.grant(SlotRequest("r1", "prefill-0", tokens * zone.token_bytes, tokens, max_slots=1))
    assert late.fatal and late.error and not late.slots  # a straggling round gets nothing
    assert await _idle(zone, engine)


async def test_slots_filled_without_checksums_is_refused(decode, engine):
    zone = decode.zone
    reply = await zone.grant(SlotRequest("r1", "prefill-0", 16 * zone.token_bytes, 16, max_slots=1))
    ack = await zone.filled(SlotsFilled("r1", [[reply.slots[0][0], 0, 16 * zone.token_bytes]]))
    assert not ack.ok and ack.error == UNVERIFIED and zone.checks == HandoffChecks(unverified=1)
    assert await _idle(zone, engine)
    assert decode.load_report().detail["handoff_crc_unverified"] == 1


# ---------------------------------------------------------------- real Transfer Engines + nats, in process


@pytest.mark.parametrize("register_pages", [pytest.param(True, id="registered"), pytest.param(False, id="foreign")])
async def test_a_slot_corrupted_in_flight_by_a_second_write_fails_the_handoff_cleanly(tiny, monkeypatch,
                                                                                     register_pages):
    from tests.natsbus import nats_url

    prompt = tiny.tokenizer.encode("def checksum(data):\n    crc = 0\n    for byte in data:\n" * 3)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    [want] = Engine(tiny, EngineConfig(num_blocks=64, enable_prefix_cache=False)).generate([prompt], params)

    p_engine, d_engine = Engine(tiny, EngineConfig(num_blocks=64)), Engine(tiny, EngineConfig(num_blocks=NUM_BLOCKS))
    layout = p_engine.layout
    slot_bytes = 2 * layout.block_size * layout.bytes_per_token  # 2 blocks a slot: several writes a handoff
    cfg = TransferConfig(slot_bytes=slot_bytes, slots=4, max_slots_per_round=2, timeout_s=20,
                         register_pages=register_pages)
    assert len(prompt) > 2 * 2 * layout.block_size  # more than one round
    with nats_url() as url:
        async with handoff_pair(url, p_engine, d_engine, cfg) as h:
            p_bus, p_te, decode, sender, rogue = h.p_bus, h.p_te, h.decode, h.sender, KVTransport()
            assert sender.copies.foreign == decode.zone.copies.foreign == (not register_pages)
            flip = torch.zeros(1, dtype=torch.uint8)  # the rogue engine's registered source byte
            rogue.register(flip)
            real_write, corrupted, written = p_te.write, [], []

            def write_then_corrupt(peer, src, dst, lens):
                real_write(peer, src, dst, lens)
                for j in range(len(lens)):  # the handoff's second piece, after prefill wrote it, before decode checks
                    if len(written) == 1 and not corrupted:
                        k = lens[j] // 3
                        flip[0] = ctypes.string_at(src[j] + k, 1)[0] ^ 0xFF
                        rogue.write(peer, [flip.data_ptr()], [dst[j] + k], [1])
                        corrupted.append(dst[j] + k)
                    written.append(dst[j])

            monkeypatch.setattr(p_te, "write", write_then_corrupt)
            try:
                async def prefill(rid: str) -> tuple[list[int], HandoffDone]:
                    seq = p_engine.add_request(rid, prompt, params, prefill_only=True, retain_kv=True)
                    while not p_engine.step():
                        pass
                    done = HandoffDone(rid, seq.prompt_ids, seq.output_ids, seq.output_text, params,
                                       {"device": 0, "store": 0, "computed": len(prompt)})
                    return list(seq.block_table), done

                table, done = await prefill("bad")
                with pytest.raises(HandoffFailed, match="checksum mismatch"):
                    await sender.send("decode-0", "bad", table, len(prompt), done)
                p_engine.block_manager.release(reversed(table))
                assert corrupted and decode.zone.checks.failures == 1
                await asyncio.sleep(0.2)  # a straggling ack of the pipelined round, if any, lands first
                report = decode.load_report().detail
                assert report["handoff_crc_failures"] == 1 and report["landing"] == 0
                assert report["free_slots"] == cfg.slots and not decode.active
                assert await decode.loop.call(lambda: d_engine.block_manager.num_free_blocks) == NUM_BLOCKS

                chunks, finished = await collect_chunks(p_bus, "good")
                table, done = await prefill("good")
                stats = await sender.send("decode-0", "good", table, len(prompt), done)
                p_engine.block_manager.release(reversed(table))
                assert stats.writes == -(-len(prompt) * layout.bytes_per_token // slot_bytes) and stats.crc_ms > 0
                await asyncio.wait_for(finished.wait(), 30)
                got = done.output_ids + [t for c in chunks for t in c.token_ids]
                assert got == want.output_ids and not any(c.error for c in chunks)
                # the bad handoff's first piece passed its check (scattered, then freed with the rest) unless the
                # refusal of the second (its own SlotsFilled, pipelined) dropped the landing first
                checks = decode.zone.checks
                assert checks.failures == 1 and checks.unverified == 0
                assert stats.writes <= checks.verified <= stats.writes + 1
            finally:
                rogue.close()


# ---------------------------------------------------------------- the whole system

CORRUPTED = 4  # handoffs decode corrupts (the first span of each: the direct handoff, the default)
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def system(tmp_path_factory, tiny):
    import dataclasses

    from shared.config import load_config
    from infra.up import UpConfig, launched
    from tests.natsbus import nats_url

    run_dir = tmp_path_factory.mktemp("crc")
    with nats_url() as url, pytest.MonkeyPatch.context() as mp:
        mp.setenv(FAULT_ENV, str(CORRUPTED))  # the services inherit it; only decode reads it
        cfg = load_config(UpConfig, overrides=[
            "up.model=tiny", "up.port=0", f"up.nats_url={url}", f"up.run_dir={run_dir}",
            "up.pool=false", "up.ready_timeout_s=120", "decode.engine.num_blocks=256",
            # a restarted decode would start corrupting anew
            *(["up.restart=no"] if "restart" in {f.name for f in dataclasses.fields(UpConfig().up)} else []),
        ])
        with launched(cfg) as (launcher, base):
            mp.delenv(FAULT_ENV)
            yield base, url


def _reference(tiny, prompt: str) -> str:
    engine = Engine(tiny, EngineConfig(num_blocks=64, enable_prefix_cache=False))
    [seq] = engine.generate([tiny.tokenizer.encode(prompt)], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    return seq.output_text


def _complete(base: str, prompt: str, stream: bool) -> tuple[int, str, list[dict]]:
    """(status, text, error objects) of one greedy completion through the router."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    if not stream:
        r = httpx.post(base + "/v1/completions", json=body, timeout=60)
        ok = r.status_code == 200
        return r.status_code, r.json()["choices"][0]["text"] if ok else "", [] if ok else [r.json()["error"]]
    text, errors = [], []
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines and lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        event = json.loads(line[6:])
        if "error" in event:
            errors.append(event["error"])
        else:
            text.append(event["choices"][0]["text"])
    return r.status_code, "".join(text), errors


def _retries(base: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(base + "/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "moorage_router_retries_total")


def test_corrupted_handoffs_end_in_a_retry_or_a_503_and_never_in_wrong_tokens(system, tiny):
    from tests.natsbus import latest_reports

    base, url = system
    prompts = [f"def handoff_{i}(kv):\n    return" for i in range(4)]
    want = {p: _reference(tiny, p) for p in prompts}
    retries = _retries(base)

    # 1: corrupted, retried, corrupted again: a 503 (no third try), nothing served
    status, text, errors = _complete(base, prompts[0], stream=False)
    assert (status, text) == (503, "") and errors[0]["code"] == "service_unavailable"
    # 2: a stream whose first token (sampled by prefill) was already sent: an error event, then [DONE]
    status, text, errors = _complete(base, prompts[1], stream=True)
    assert status == 200 and len(errors) == 1 and errors[0]["code"] == "service_unavailable"
    assert want[prompts[1]].startswith(text) and len(text) < len(want[prompts[1]])  # right so far, then cut
    # 3: corrupted once (the last corruption), retried: the right answer
    assert _complete(base, prompts[2], stream=False) == (200, want[prompts[2]], [])
    # 4: clean
    assert _complete(base, prompts[3], stream=True) == (200, want[prompts[3]], [])
    assert _retries(base) - retries == 2  # requests 1 and 3

    def decode_idle(seen: dict) -> bool:
        d = [r for r in seen.values() if r.role == "decode"]
        return bool(d) and d[0].detail["landing"] == 0 and d[0].running == 0 \
            and d[0].free_tokens == d[0].capacity_tokens

    reports = asyncio.run(latest_reports(url, enough=decode_idle))
    [decode] = [r for r in reports.values() if r.role == "decode"]
    assert decode_idle(reports), decode
    assert decode.detail["handoff_crc_failures"] == CORRUPTED and decode.detail["handoff_crc_unverified"] == 0
    # requests 3 (its retry) and 4: one check per span written, and a 2-block prompt is 1 span, or 2 when
    # decode's blocks for it are not consecutive
    assert 2 <= decode.detail["handoff_crc_verified"] <= 4
    assert decode.detail["free_slots"] == TransferConfig().slots  # every landing slot back

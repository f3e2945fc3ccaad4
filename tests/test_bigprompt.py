"""Long prompts over the bus (issue 10): token ids travel packed (4 bytes each), the embedded nats-server
takes 8 MiB messages, so a whole 1M-token context crosses a real nats-server; what still does not fit is a
PayloadTooLarge before anything is sent (the router turns it into a 413: test_router_api.py). End to end, a
prompt of the deployment's whole context goes through prefill, the KV handoff and decode on the tiny model
and matches the greedy reference."""

from __future__ import annotations

import asyncio
import tempfile

import httpx
import numpy as np
import pytest

from infra.natsd import NatsServer, start_nats_server
from infra.up import UpConfig, launched
from shared.bus import DEFAULT_MAX_MESSAGE_BYTES, Bus, BusConfig, PayloadTooLarge
from shared.config import load_config
from shared.engine.engine import Engine, EngineConfig
from shared.engine.sampling import SamplingParams
from shared.messages import Ack, HandoffDone, PrefillSubmit
from tests.natsbus import nats_url

MILLION = 1_000_000
SAMPLING = SamplingParams(max_tokens=8)


def ids_of(n: int, vocab: int = 200_000) -> list[int]:
    return ((np.arange(n, dtype=np.int64) * 2654435761) % vocab).tolist()


async def _echo_bus(url: str) -> tuple[Bus, Bus]:
    """A sender and a responder that answers each PrefillSubmit with its length and checksum."""
    sender = await Bus.connect(BusConfig(url=url, prefix="big"), "sender")
    responder = await Bus.connect(BusConfig(url=url, prefix="big"), "responder")

    async def on_submit(msg: PrefillSubmit, _raw) -> Ack:
        ids = np.asarray(msg.prompt_ids, dtype=np.int64)
        return Ack(msg.request_id, True, stats={"n": int(ids.size), "sum": int(ids.sum()),
                                                "last": int(ids[-1]), "tenant": msg.tenant})

    await responder.subscribe(responder.subjects.prefill_submit("p0"), PrefillSubmit, on_submit)
    await responder.nc.flush()
    return sender, responder


def test_a_million_token_ids_cross_a_real_nats_server():
    ids = ids_of(MILLION)

    async def go():
        server = start_nats_server()
        sender, responder = await _echo_bus(server.url)
        try:
            assert sender.max_message_bytes == DEFAULT_MAX_MESSAGE_BYTES  # the server takes 8 MiB
            msg = PrefillSubmit("r-1m", ids, SAMPLING, "decode-0", tenant="acme")
            assert len(msg.encode()) < 4 * MILLION + 512
            ack = await sender.request(sender.subjects.prefill_submit("p0"), msg, Ack, timeout=30)
            assert ack.stats == {"n": MILLION, "sum": sum(ids), "last": ids[-1], "tenant": "acme"}

            got: asyncio.Future = asyncio.get_running_loop().create_future()

            async def on_done(done: HandoffDone, _raw) -> None:
                got.set_result(done)

            await responder.subscribe(responder.subjects.decode_landed("d0"), HandoffDone, on_done)
            await responder.nc.flush()
            await sender.publish(sender.subjects.decode_landed("d0"), HandoffDone(
                "r-1m", ids, [5], "x", SAMPLING, {"computed": MILLION}))
            done = await asyncio.wait_for(got, 30)
            assert done.prompt_ids == ids and done.output_ids == [5]

            # about 2.1M ids do not fit: refused before sending, and the connection stays usable
            with pytest.raises(PayloadTooLarge, match="exceeds the bus cap"):
                await sender.request(sender.subjects.prefill_submit("p0"),
                                     PrefillSubmit("r-2m", ids_of(2_100_000), SAMPLING, "decode-0"), Ack, timeout=5)
            ack = await sender.request(sender.subjects.prefill_submit("p0"),
                                       PrefillSubmit("r-small", [1, 2, 3], SAMPLING, "decode-0"), Ack, timeout=5)
            assert ack.stats["n"] == 3
        finally:
            await sender.close()
            await responder.close()
            server.stop()

    asyncio.run(go())


def test_a_server_with_a_smaller_max_payload_lowers_the_cap():
    """A NATS server left at its 1 MiB default: the bus cap follows it (a PayloadTooLarge, not a client
    MaxPayloadError or a server that drops the connection)."""
    async def go():
        server = NatsServer(tempfile.mkdtemp(prefix="moorage-nats-1mib-"), max_payload=1 << 20)
        server.spawn()
        server.wait_port()
        sender, responder = await _echo_bus(server.url)
        try:
            assert sender.max_message_bytes < 1 << 20
            with pytest.raises(PayloadTooLarge, match=f"bus cap of {sender.max_message_bytes}"):
                await sender.request(sender.subjects.prefill_submit("p0"),
                                     PrefillSubmit("r", ids_of(300_000), SAMPLING, "decode-0"), Ack, timeout=5)
            ack = await sender.request(sender.subjects.prefill_submit("p0"),
                                       PrefillSubmit("r", ids_of(200_000), SAMPLING, "decode-0"), Ack, timeout=5)
            assert ack.stats["n"] == 200_000  # 800 KB: fits
        finally:
            await sender.close()
            await responder.close()
            server.stop()

    asyncio.run(go())


# ---- end to end -------------------------------------------------------------------------------------------
CONTEXT = 4096  # router.max_request_tokens: the deployment's whole context (tiny computes ~1K tokens/s here)


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("bigprompt")
    with nats_url() as url:
        cfg = load_config(UpConfig, overrides=[
            "up.model=tiny", "up.port=0", f"up.nats_url={url}", f"up.run_dir={run_dir}",
            "up.ready_timeout_s=120", "up.pool=false", f"router.router.max_request_tokens={CONTEXT}",
        ])
        with launched(cfg) as (_launcher, base):
            yield base


def test_a_prompt_of_the_whole_context_is_served_and_matches_greedy(system, tiny):
    max_tokens = 8
    prompt = [int(t) % 256 for t in ids_of(CONTEXT - max_tokens, 256)]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    r = httpx.post(system + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] == CONTEXT - max_tokens and usage["completion_tokens"] == max_tokens
    engine = Engine(tiny, EngineConfig(num_blocks=CONTEXT // 16 + 4, enable_prefix_cache=False))
    [ref] = engine.generate([prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    assert r.json()["choices"][0]["text"] == ref.output_text

    over = httpx.post(system + "/v1/completions", json={**body, "prompt": prompt + [7]}, timeout=60)
    assert over.status_code == 400 and over.json()["error"]["code"] == "context_length_exceeded"

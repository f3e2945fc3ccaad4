"""The embedded bus is closed by default and survives its own restart: a per-run user/password (0600 on
disk, never on a command line), an unauthenticated client is refused, and clients reconnect, resubscribe
and even make their first connection while the server is (re)starting."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import stat
import time

import nats
import pytest

from infra.natsd import CREDENTIAL_FILE, MAX_PAYLOAD_BYTES, NatsCredential, start_nats_server
from infra.procs import cmdline
from infra.up import Launcher, UpConfig
from shared.bus import Bus, BusConfig
from shared.config import load_config
from shared.messages import Cancel


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def server():
    s = start_nats_server(credential=NatsCredential.generate())
    yield s
    s.stop()


async def _quiet(e: Exception) -> None:
    pass


async def refused(url: str) -> str:
    try:
        nc = await nats.connect(url, connect_timeout=2, allow_reconnect=False, error_cb=_quiet)
    except Exception as e:
        return str(e)
    await nc.close()
    return ""


def test_unauthenticated_and_wrong_clients_are_refused(server):
    cred = server.credential
    assert "Authorization Violation" in asyncio.run(refused(server.address))
    wrong = server.address.replace("nats://", f"nats://{cred.user}:not-{cred.password}@")
    assert "Authorization Violation" in asyncio.run(refused(wrong))
    assert asyncio.run(refused(server.url)) == ""  # the URL with the credential connects

    async def info() -> int:
        bus = await Bus.connect(BusConfig(url=server.address, user=cred.user, password=cred.password), "t")
        try:
            return bus.nc.max_payload
        finally:
            await bus.close()
    assert asyncio.run(info()) == MAX_PAYLOAD_BYTES


def test_credential_is_private_and_not_on_the_command_line(server, tmp_path):
    assert mode(server.config_path) == 0o600 and mode(server.workdir) == 0o700
    assert server.credential.password not in cmdline(server.process.pid)
    path = tmp_path / CREDENTIAL_FILE
    path.write_text("{}")
    os.chmod(path, 0o644)
    server.credential.save(path)  # an existing, wider file is narrowed
    assert mode(path) == 0o600 and NatsCredential.load(path) == server.credential
    assert NatsCredential.load(tmp_path / "missing") is None


def test_clients_reconnect_resubscribe_and_wait_for_a_restarting_server(server):
    cred = server.credential
    config = BusConfig(url=server.address, user=cred.user, password=cred.password, request_timeout_s=2)

    async def scenario() -> None:
        back = {"a": asyncio.Event(), "b": asyncio.Event()}

        def reconnected(name: str):
            async def cb() -> None:  # nats-py calls it after its own PING/PONG: the SUBs were replayed
                back[name].set()
            return cb
        a, b = [await Bus.connect(config, n, reconnected_cb=reconnected(n)) for n in ("a", "b")]
        got: asyncio.Queue = asyncio.Queue()

        async def on_cancel(msg: Cancel, raw) -> None:
            await got.put(msg.request_id)
        await b.subscribe("t.cancel", Cancel, on_cancel)
        await b.nc.flush()  # the subscription is at the server

        async def delivered(sender: Bus, rid: str) -> bool:
            """NATS core is at-most-once (CI once lost a message on a healthy connection under load), so the
            sender publishes, flushed, until b's handler has it, for up to 15 s: b's subscription works."""
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                await sender.publish("t.cancel", Cancel(request_id=rid))
                await sender.nc.flush(timeout=5)
                with contextlib.suppress(asyncio.TimeoutError):
                    while await asyncio.wait_for(got.get(), 2) != rid:
                        pass
                    return True
            return False
        assert await delivered(a, "before")

        server.process.kill()  # kill -9; nothing listens until the restart below
        await asyncio.to_thread(server.process.wait)
        late = asyncio.create_task(Bus.connect(config, "late"))  # a first connect while the server is down
        await asyncio.sleep(1.0)
        assert not late.done()
        await asyncio.to_thread(server.spawn)  # same port, same credential
        c = await asyncio.wait_for(late, 15)
        # Wait for both to be back: nats-py's flush() returns at once while a client is still reconnecting
        # (its flusher task is down then), so it proves nothing about b's restored subscription.
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in back.values())), 15)
        assert await delivered(a, "after")  # b's subscription was restored
        assert await delivered(c, "late")
        for bus in (a, b, c):
            await bus.close()

    asyncio.run(scenario())


def test_up_makes_a_credential_per_run_and_gives_it_to_every_service(tmp_path):
    """`moorage up`'s files, without waiting for the services (they are stopped right after the spawn)."""
    run_dir = tmp_path / "run"
    cfg = load_config(UpConfig, overrides=["up.model=tiny", "up.port=0", f"up.run_dir={run_dir}",
                                           "up.pool=false", "up.kv_memory=256MiB"], env={})
    launcher = Launcher(cfg, say=lambda line: None)
    try:
        launcher.start()
        cred_file = run_dir / CREDENTIAL_FILE
        cred = NatsCredential.load(cred_file)
        assert cred is not None and mode(cred_file) == 0o600
        assert launcher.credential == cred and launcher.nats.credential == cred
        tomls = sorted(run_dir.glob("*.toml"))
        assert {p.stem for p in tomls} == {"gate-0", "decode-0", "prefill-0", "router-0"}
        for p in tomls:
            assert mode(p) == 0o600 and cred.password in p.read_text(), p
        state = json.loads((run_dir / "up.json").read_text())
        assert cred.password not in json.dumps(state) and state["credential_file"] == CREDENTIAL_FILE
        assert "Authorization Violation" in asyncio.run(refused(state["nats_url"]))
        nats_pid = state["pids"]["nats-server"]
        assert cred.password not in cmdline(nats_pid) and str(run_dir) in cmdline(nats_pid)
        second = NatsCredential.generate()
        assert second != cred  # per run
    finally:
        launcher.stop()
    assert not (run_dir / CREDENTIAL_FILE).exists() and not (run_dir / "nats").exists()

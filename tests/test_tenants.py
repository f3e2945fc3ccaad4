"""Tenant isolation per API key (issue 10): a request's tenant salts its KV namespace in the device prefix
cache, the pool's keys and the router's routing index, so one tenant's `cached_tokens` says nothing about
another's prompts, while keys of one tenant share. Pure logic and the in-process engine first; then the
whole system (`moorage up --model tiny` with the pool) with four keys of three tenants."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from services.router.config import RouterConfig, RouterSettings
from services.router.routing import LoadTable, make_picker
from shared.config import ConfigError, load_config
from shared.engine.engine import Engine, EngineConfig
from shared.engine.sampling import SamplingParams
from shared.hashing import BLOCK_TOKENS, block_hashes, namespace_seed
from shared.kv_object import object_key
from shared.kv_tenant import KVNamespace, tenant_namespace
from shared.messages import LoadReport
from infra.up import UpConfig, launched
from tests.natsbus import latest_reports, nats_url

NS = "mrg1-0123456789abcdef"
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


# ---- the namespace ----------------------------------------------------------------------------------------
def test_tenant_namespace_is_stable_distinct_and_fits_object_headers():
    assert tenant_namespace(NS, "") == NS and KVNamespace.of(NS).seed == namespace_seed(NS)
    a, b = tenant_namespace(NS, "acme"), tenant_namespace(NS, "blue")
    assert a == tenant_namespace(NS, "acme") and len({NS, a, b}) == 3
    assert tenant_namespace("mrg1-fedcba9876543210", "acme") != a  # another deployment, another salt
    assert len(tenant_namespace(NS, "t" * 256).encode()) <= 64
    object_key(a, 0, 1, bytes(16))  # a valid key
    assert KVNamespace.of(NS, "acme").seed == namespace_seed(a) != namespace_seed(b)


# ---- config -----------------------------------------------------------------------------------------------
def test_api_key_tenants_config(tmp_path):
    path = tmp_path / "router.toml"
    path.write_text('[router]\napi_keys = ["sk-shared"]\nmetrics_require_key = true\n\n'
                    '[router.api_key_tenants]\n"sk-a1" = "acme"\n"sk-a2" = "acme"\n"sk-b" = "blue"\n')
    s = load_config(RouterConfig, path=path, env={}).router
    assert s.key_tenants == {"sk-shared": "", "sk-a1": "acme", "sk-a2": "acme", "sk-b": "blue"}
    assert s.metrics_require_key
    env = load_config(RouterConfig, env={"MOORAGE__ROUTER__API_KEY_TENANTS": '{"k": "t"}'}).router
    assert env.key_tenants == {"k": "t"}
    for bad, needle in [({"": "t"}, "empty keys"), ({"k": ""}, "1-256 characters"),
                        ({"k": "t" * 257}, "1-256 characters")]:
        with pytest.raises(ConfigError, match=needle):
            RouterSettings(api_key_tenants=bad)
    with pytest.raises(ConfigError, match="in one place"):
        RouterSettings(api_keys=["k"], api_key_tenants={"k": "t"})
    assert RouterSettings().key_tenants == {}


# ---- the device prefix cache ------------------------------------------------------------------------------
def test_engine_prefix_cache_is_per_tenant(tiny):
    engine = Engine(tiny, EngineConfig(num_blocks=64))
    prompt = [(i * 7) % 250 for i in range(5 * BLOCK_TOKENS + 3)]

    def run(rid: str, tenant: str):
        seq = engine.add_request(rid, prompt, GREEDY, tenant=tenant)
        while engine.has_unfinished():
            engine.step()
        return seq.num_device_cached, seq.output_ids

    first = run("a1", "acme")
    assert first[0] == 0
    for rid, tenant, cached in [("b1", "blue", 0), ("d1", "", 0), ("a2", "acme", 5 * BLOCK_TOKENS),
                                ("b2", "blue", 5 * BLOCK_TOKENS), ("d2", "", 5 * BLOCK_TOKENS)]:
        assert run(rid, tenant) == (cached, first[1]), (rid, tenant)
    # three copies of the prompt's blocks: one per namespace, none shared
    assert engine.block_manager.num_cached_blocks == 3 * 5
    engine.block_manager.check_integrity()


# ---- the routing index ------------------------------------------------------------------------------------
def test_routing_index_counts_only_the_requests_tenant():
    prompt = list(range(8 * BLOCK_TOKENS))
    picker = make_picker("cache-aware", LoadTable(5.0), 60.0, random.Random(0))
    for name in ("p0", "p1"):
        picker.update(LoadReport(name, "prefill", True, detail={"kv_namespace": NS}), 0.0)
    acme = block_hashes(prompt, KVNamespace.of(NS, "acme").seed)  # what p1's KV events say after acme's turn
    picker.index.apply("p1", [{"type": "stored", "hashes": acme, "medium": "device"}])
    for tenant, resident, reason in [("acme", 8 * BLOCK_TOKENS, "cache"), ("blue", 0, "load"), ("", 0, "load")]:
        choice = picker.pick(None, 0.1, len(prompt), prompt, tenant=tenant)
        assert (picker.last.reason, picker.last.resident_tokens or 0) == (reason, resident), tenant
        assert choice == "p1" or reason == "load"


# ---- the whole system -------------------------------------------------------------------------------------
KEYS = {"sk-acme-1": "acme", "sk-acme-2": "acme", "sk-blue": "blue"}
SHARED_KEY = "sk-shared"  # router.api_keys: the deployment's own namespace


@pytest.fixture(scope="module")
def system(tmp_path_factory, tiny):
    run_dir = tmp_path_factory.mktemp("tenants")
    with nats_url() as url:
        keys = ", ".join(f'"{k}": "{t}"' for k, t in KEYS.items())
        cfg = load_config(UpConfig, overrides=[
            "up.model=tiny", "up.port=0", f"up.nats_url={url}", f"up.run_dir={run_dir}",
            "up.ready_timeout_s=120",
            f"router.router.api_keys={SHARED_KEY}", f"router.router.api_key_tenants={{{keys}}}",
        ])
        with launched(cfg) as (_launcher, base):
            yield base, url


def _complete(base: str, key: str, prompt: list[int]) -> dict:
    r = httpx.post(base + "/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=120, json={
        "model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def _cached(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def _saved_chunks(url: str, at_least: int) -> int:
    """The prefill's saved pool chunks, once they reach `at_least` (saves are asynchronous)."""
    def enough(seen):
        return any(r.role == "prefill" and ((r.detail.get("pool") or {}).get("saved_chunks", 0) >= at_least)
                   for r in seen.values())

    seen = asyncio.run(latest_reports(url, seconds=0.6, enough=enough))
    return max((r.detail.get("pool") or {}).get("saved_chunks", 0) for r in seen.values() if r.role == "prefill")


def test_cached_tokens_are_shared_within_a_tenant_and_never_across(system, tiny):
    base, url = system
    prompt = [(i * 13 + 5) % 256 for i in range(600)]  # two full pool chunks and change
    engine = Engine(tiny, EngineConfig(num_blocks=128, enable_prefix_cache=False))
    [ref] = engine.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))

    first = _complete(base, "sk-acme-1", prompt)
    assert _cached(first) == 0
    assert _saved_chunks(url, 2) >= 2  # acme's chunks are in the pool now: a leak would show as a restore
    turns = [("sk-acme-1", 0)]
    for key, want in [("sk-blue", 0), (SHARED_KEY, 0), ("sk-acme-2", "hit"), ("sk-blue", "hit"),
                      (SHARED_KEY, "hit")]:
        body = _complete(base, key, prompt)
        cached = _cached(body)
        if want == "hit":
            assert cached >= 592, (key, body["usage"])  # every full block of the prompt
        else:
            assert cached == 0, (key, body["usage"])
        assert body["choices"][0]["text"] == ref.output_text, key
        turns.append((key, cached))
    print("cached_tokens by turn:", turns)


def test_unknown_key_is_refused(system):
    base, _ = system
    r = httpx.post(base + "/v1/completions", headers={"Authorization": "Bearer sk-acme-3"}, timeout=30,
                   json={"model": "tiny", "prompt": "x", "max_tokens": 1})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"

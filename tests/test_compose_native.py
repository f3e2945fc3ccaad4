"""compose/docker-compose.yml run natively (no Docker daemon here): every moorage service's `command` with its
`environment` as a process on loopback, started in `depends_on` order behind the healthchecks as compose
would run them, NATS from the nats service's flags, and the real Prometheus (Debian's package) on
compose/prometheus.yml with its targets mapped to loopback. Every target must be `up` through Prometheus's
HTTP API, and one chat completion goes through the port the router publishes. Catches a wrong command, an
unknown config key, a wrong port or name, and a missing health endpoint. Jaeger and Grafana are not run
(tests/test_deploy.py validates their wiring)."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import json
import shutil
from pathlib import Path

import httpx
import pytest
import yaml

from tests.compose_native import ComposeError, compose_model, native_plan
from tests.compose_runner import ComposeRun
from shared.sockets import free_port

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "compose"
UP_BOUND_S = 150     # compose itself would wait out start_period (300 s); a healthy start here takes ~40 s
TARGETS_BOUND_S = 60  # Prometheus scrapes every 5 s


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    if not shutil.which("prometheus"):
        pytest.fail("the prometheus binary is missing: infra/dev-env.sh installs Debian's `prometheus` package")
    scratch = tmp_path_factory.mktemp("compose-native")
    model = compose_model(COMPOSE)
    plan = native_plan(model, scratch, free_port)
    run = ComposeRun(plan, scratch / "logs")
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(run.up(UP_BOUND_S))
        yield model, run, loop
    finally:
        loop.run_until_complete(run.down())
        loop.close()


def _service_of(run: ComposeRun) -> dict[str, str]:
    """loopback 'host:port' -> 'service:container port' (to read Prometheus's targets back)."""
    return {f"127.0.0.1:{port}": f"{svc}:{cport}" for (svc, cport), port in run.plan.ports.ports.items()}


async def _targets(run: ComposeRun, expected: int, bound_s: float) -> list[dict]:
    """Prometheus's active targets once `expected` of them are all up (or whatever it has after bound_s)."""
    url = f"http://127.0.0.1:{run.plan.ports.ports[('prometheus', 9090)]}/api/v1/targets?state=active"
    exited = run.exited("prometheus")
    deadline = asyncio.get_running_loop().time() + bound_s
    targets: list[dict] = []
    async with httpx.AsyncClient(timeout=5) as http:
        while asyncio.get_running_loop().time() < deadline and not exited.done():
            with contextlib.suppress(httpx.TransportError):  # not listening yet
                r = await http.get(url)
                targets = r.json()["data"]["activeTargets"] if r.status_code == 200 else targets
            if len(targets) == expected and all(t["health"] == "up" for t in targets):
                break
            await asyncio.wait({exited}, timeout=1.0)  # Prometheus has no push for target health
    if exited.done():
        raise ComposeError(f"prometheus exited\n{run.log('prometheus')}")
    exited.cancel()
    return targets


def _expected_targets() -> int:
    conf = yaml.safe_load((COMPOSE / "prometheus.yml").read_text())
    return sum(len(sc["targets"]) for job in conf["scrape_configs"] for sc in job["static_configs"])


def test_every_service_comes_up_healthy_in_depends_on_order(stack):
    model, run, _ = stack
    # every moorage service runs under `moorage watch`: its process's end is announced on the bus (issue 33)
    moorage = {n for n, s in model["services"].items() if (s.get("command") or [""])[0] == "watch"}
    assert moorage == {"master", "store-0", "store-1", "gate", "prefill", "decode", "router"}
    assert set(run.plan.launches) == moorage | {"nats", "prometheus"}
    assert all(run.healthy[n].is_set() and run.procs[n].returncode is None for n in run.plan.launches)
    order = list(run.plan.launches)
    for name, launch in run.plan.launches.items():
        assert all(order.index(dep) < order.index(name) for dep in launch.depends_on if dep in order)
    print("healthy after (s, from each start):", {n: round(s, 1) for n, s in run.waited_s.items()})


def test_prometheus_scrapes_every_target_up(stack):
    model, run, loop = stack
    targets = loop.run_until_complete(_targets(run, _expected_targets(), TARGETS_BOUND_S))
    named = _service_of(run)
    seen = {(t["labels"]["job"], named.get(t["labels"]["instance"], t["labels"]["instance"])): t["health"]
            for t in targets}
    print("prometheus targets:", json.dumps({f"{j} {s}": h for (j, s), h in sorted(seen.items())}))
    assert len(targets) == _expected_targets(), seen
    assert all(h == "up" for h in seen.values()), {k: (h, t["lastError"]) for t in targets for k, h in seen.items()
                                                  if h != "up" and named.get(t["labels"]["instance"]) == k[1]}
    # and each target is the service it is named after: the role its figures carry is the one its command runs
    prom = f"http://127.0.0.1:{run.plan.ports.ports[('prometheus', 9090)]}"
    result = httpx.get(f"{prom}/api/v1/query", params={"query": 'moorage_ready{job="moorage"}'}).json()["data"]["result"]
    roles = {named[r["metric"]["instance"]].split(":")[0]: r["metric"]["role"] for r in result}
    assert roles == {n: model["services"][n]["command"][1] for n in roles}
    assert set(roles) == {s.split(":")[0] for (job, s) in seen if job == "moorage"}


def test_chat_completion_through_the_published_router_port(stack):
    model, run, _ = stack
    router = model["services"]["router"]
    (published,) = [p for p in router["ports"] if p["target"] == 8000]
    port = run.plan.published[(published["host_ip"], int(published["published"]))]
    key = json.loads(router["environment"]["MOORAGE__ROUTER__API_KEYS"])[0]
    r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60,
                   headers={"Authorization": f"Bearer {key}"},
                   json={"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8,
                         "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"]
    assert httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={}).status_code == 401


# --- the plan alone (no processes): the compose file's own mistakes are named before anything starts


def _model_with(tmp_path: Path, service: str, edit) -> dict:
    """The real compose model with one service's config file replaced by an edited copy."""
    model = copy.deepcopy(compose_model(COMPOSE))
    (vol,) = [v for v in model["services"][service]["volumes"] if v["type"] == "bind"]
    path = tmp_path / Path(vol["source"]).name
    path.write_text(edit(Path(vol["source"]).read_text()))
    vol["source"] = str(path)
    return model


def _plan(model: dict, tmp_path: Path):
    ports = itertools.count(30000)
    return native_plan(model, tmp_path, lambda: next(ports))


def test_plan_names_a_wrong_port(tmp_path):
    model = _model_with(tmp_path, "store-0", lambda t: t.replace("master:50051", "master:50052"))
    with pytest.raises(ComposeError, match=r"store-0 \[store\] master_addr refers to master:50052.*9003, 9100, 50051"):
        _plan(model, tmp_path)


def test_plan_names_a_healthcheck_on_a_port_nobody_opens(tmp_path):
    model = copy.deepcopy(compose_model(COMPOSE))
    model["services"]["gate"]["healthcheck"]["test"][-1] = "http://127.0.0.1:9101/health"
    with pytest.raises(ComposeError, match=r"gate healthcheck refers to gate:9101"):
        _plan(model, tmp_path)


def test_plan_names_a_hostname_of_another_service(tmp_path):
    model = _model_with(tmp_path, "store-1", lambda t: t.replace('hostname = "store-1"', 'hostname = "store-0"'))
    with pytest.raises(ComposeError, match=r"store-1 \[store\] hostname = 'store-0': names another service"):
        _plan(model, tmp_path)


def test_plan_maps_every_reference_to_loopback(tmp_path):
    plan = _plan(copy.deepcopy(compose_model(COMPOSE)), tmp_path)
    store = plan.launches["store-0"].env
    master_rpc = plan.ports.ports[("master", 50051)]
    assert store["MOORAGE__STORE__MASTER_ADDR"] == f"127.0.0.1:{master_rpc}"
    assert store["MOORAGE__BUS__URL"] == f"nats://127.0.0.1:{plan.ports.ports[('nats', 4222)]}"
    assert plan.launches["master"].env["MOORAGE__MASTER__RPC_PORT"] == str(master_rpc)
    assert plan.published[("127.0.0.1", 8000)] == plan.ports.ports[("router", 8000)]
    prom = (tmp_path / "prometheus.yml").read_text()
    assert "master:" not in prom and f"127.0.0.1:{plan.ports.ports[('master', 9003)]}" in prom

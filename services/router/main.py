"""The router service: load the tokenizer, follow every instance's load reports, and serve the HTTP API
with uvicorn inside the service's own event loop (stopped by ctx.stop, before the bus is drained, so
open requests still send their Cancel / Release).
"""

from __future__ import annotations

import asyncio

import uvicorn
from nats.aio.msg import Msg

from services.router.app import create_app
from services.router.config import RouterConfig
from services.router.dispatch import RouterState
from services.router.routing import LoadTable, make_picker
from services.router.schemas import OpenAIError
from shared.engine.models import load_model_meta
from shared.messages import Holdings, InstanceExited, KVEventBatch, LoadReport
from shared.ops_http import EmbeddedServer
from shared.service import ServiceContext
from shared.sockets import inherited, listen, url_of


async def build_state(config: RouterConfig, bus, boot: str = "") -> RouterState:
    s = config.router
    tokenizer, model = await asyncio.to_thread(load_model_meta, s.model)
    loads = LoadTable(s.instance_timeout_s)
    picker = make_picker(s.routing, loads, s.session_idle_s, max_imbalance_tokens=s.cache_aware_max_imbalance_tokens)
    state = RouterState(s, bus, tokenizer, model.max_context, loads, picker, instance=config.instance,
                        recompute_knee_tokens=model.recompute_knee_tokens)
    if boot:  # the process's own incarnation (ServiceContext.boot): what an InstanceExited for it names
        state.boot = boot
    if picker.index is not None:
        state.metrics.watch_index(picker.index)
    return state


async def publish_holdings(ctx: ServiceContext, state: RouterState) -> None:
    """Every holdings_interval_s, tell the gate which requests this process may still hold budget for, so
    one whose Release was lost (the bus went down as it was sent) is freed within seconds."""
    while True:
        await asyncio.sleep(state.settings.holdings_interval_s)
        try:
            await ctx.bus.publish(ctx.bus.subjects.holdings,
                                  Holdings(state.instance, state.boot, sorted(state.holding)))
        except Exception as e:  # the bus is down (the next one goes after it is back) or the list is too long
            ctx.log.warning("holdings not sent", error=str(e), holding=len(state.holding))


async def serve(ctx: ServiceContext) -> None:
    config: RouterConfig = ctx.config
    s, log = config.router, ctx.log
    state = await build_state(config, ctx.bus, ctx.boot)

    async def on_load(report: LoadReport, _raw: Msg) -> None:
        state.picker.update(report, state.clock())

    await ctx.bus.subscribe(ctx.bus.subjects.load_all, LoadReport, on_load)

    async def on_exited(msg: InstanceExited, _raw: Msg) -> None:
        log.warning("instance exited", exited_role=msg.role, exited_instance=msg.instance, how=msg.how,
                    source=msg.source, boot=msg.boot or None)
        state.picker.exited(msg, state.clock())

    await ctx.bus.subscribe(ctx.bus.subjects.exited_all, InstanceExited, on_exited)

    index = state.picker.index
    turnover = state.turnover if s.retention == "session" else None
    if index is not None or turnover is not None:  # every prefill's and the master's KV events (advisory): the
        events = state.metrics.kv_events           # cache-aware index mirrors them, the pins weigh the pool's turnover

        async def on_kv_events(batch: KVEventBatch, _raw: Msg) -> None:
            if turnover is not None:
                turnover.apply(batch.events)
            if index is None:
                return
            bad = index.apply(batch.instance, batch.events)
            events.labels("applied").inc(len(batch.events) - bad if isinstance(batch.events, list) else 0)
            events.labels("malformed").inc(bad)

        def on_bad_batch(_error: Exception, _raw: Msg) -> None:
            events.labels("malformed").inc()

        await ctx.bus.subscribe(ctx.bus.subjects.kv_events("*"), KVEventBatch, on_kv_events, on_error=on_bad_batch)

    sock = inherited(s.listen_fd, "router") if s.listen_fd >= 0 else listen(s.host, s.port, "router", backlog=2048)
    url = url_of(sock)

    def load_report() -> LoadReport:
        return LoadReport(ctx.instance, "router", True, running=state.metrics.open_requests.count,
                          detail={"http": url, "boot": state.boot,
                                  "sessions": {**state.pauses.stats(), **state.turnover.stats()}})

    ctx.load_report = load_report
    server = EmbeddedServer(uvicorn.Config(
        create_app(state), log_config=None, access_log=False, lifespan="off", proxy_headers=False,
        timeout_graceful_shutdown=s.graceful_shutdown_s + 3, timeout_keep_alive=30))
    task = asyncio.create_task(server.serve(sockets=[sock]), name="router-http")
    try:
        await server.serving(task)
    except BaseException:
        sock.close()
        raise
    log.info("http listening", url=url, model=s.model_name, tenants=len(set(s.api_key_tenants.values())),
             max_context=state.context_limit, routing=s.routing, auth=bool(s.key_tenants))

    async def stop_http() -> None:
        """Stop accepting; give open requests graceful_shutdown_s; then end the rest with a 503 (an SSE
        error event mid-stream) so each still sends Cancel / Release while the bus is up."""
        server.should_exit = True
        await state.metrics.open_requests.drained(s.graceful_shutdown_s)
        for dispatch in list(state.live):
            dispatch.abort(OpenAIError(503, "the router is shutting down", code="service_unavailable"))
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout=5.0)
        except (asyncio.TimeoutError, Exception):
            server.force_exit = True
            task.cancel()
        sock.close()
        if not await state.metrics.open_requests.drained(3.0):  # requests uvicorn cancelled end in the background
            log.warning("requests still open at shutdown", in_flight=state.metrics.open_requests.count)

    ctx.on_stop.append(stop_http)
    holdings = asyncio.create_task(publish_holdings(ctx, state), name="router-holdings")

    async def stop_holdings() -> None:
        holdings.cancel()
        await asyncio.gather(holdings, return_exceptions=True)

    ctx.on_stop.append(stop_holdings)  # hooks run in reverse: it stops before the HTTP server
    task.add_done_callback(lambda t: ctx.stop.set())  # the server died on its own: stop the service

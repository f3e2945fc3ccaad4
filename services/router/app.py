"""The router's HTTP API: an OpenAI-compatible FastAPI app over a RouterState (bus, tokenizer, loads), behind
HotRoutes, which serves the two generation routes without FastAPI's layers.

Routes: POST /v1/chat/completions, POST /v1/completions, POST /v1/messages (Anthropic), POST /v1/responses
(see generate.py and api_*.py), POST /v1/messages/count_tokens, GET /v1/models, GET /health
(200 only while a ready gate, prefill and decode have reported recently), GET /metrics (Prometheus; needs
the API key when router.metrics_require_key), GET /openapi.json (openapi.py).
Every error, including FastAPI's own (422 validation, 404 route, 405 method), is an OpenAI error object.
"""

from __future__ import annotations

import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.router import openapi
from services.router.api_anthropic import CountTokensRequest, Messages, conversation, error_body
from services.router.api_openai import ChatCompletions, Completions
from services.router.api_responses import Responses
from services.router.dispatch import RouterState
from services.router.generate import Generation
from services.router.prepare import authorize, count_tokens
from services.router.schemas import OpenAIError

REQUIRED_ROLES = ("gate", "prefill", "decode")
HOT_ROUTES = {"/v1/completions": Completions(), "/v1/chat/completions": ChatCompletions(),  # path -> its Api
              "/v1/messages": Messages(), "/v1/responses": Responses()}


class HotRoutes:
    """The router's ASGI app: `POST /v1/completions` and `POST /v1/chat/completions` go straight to a
    Generation (it reads the body, answers every error as an OpenAI error object and sends the response
    itself); everything else, and those paths with another method, go to the FastAPI app. FastAPI's
    middleware and route layers cost ~0.2-0.3 ms a request here (bench/overhead_floors.py); the FastAPI
    app still lists the two routes (OpenAPI schema; a test client that calls it directly)."""

    def __init__(self, app: FastAPI, state: RouterState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send) -> None:
        api = HOT_ROUTES.get(scope.get("path", "")) if scope["type"] == "http" and scope["method"] == "POST" else None
        if api is None:
            await self.app(scope, receive, send)
            return
        started = False

        async def sending(message) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            await Generation(self.state, Request(scope, receive), api).respond(scope, receive, sending)
        except Exception:  # Generation answers its own errors: this is a bug; never a plain-text 500
            if started:
                raise
            await api.error_response(OpenAIError(500, "internal error in the router"))(scope, receive, send)


def create_app(state: RouterState) -> HotRoutes:
    """The router's ASGI app (HotRoutes over the FastAPI app)."""
    return HotRoutes(create_fastapi(state), state)


MAX_SESSION_CHARS = 256


def create_fastapi(state: RouterState) -> FastAPI:
    # FastAPI's own OpenTelemetry spans are off: they traced every GET /health and GET /metrics poll (a
    # quarter of all spans) and made each request a second trace beside router.request, which is the
    # request's server span (it continues a client's traceparent) and the root of its one trace.
    app = FastAPI(title="moorage router", docs_url=None, redoc_url=None, openapi_url="/openapi.json",
                  telemetry={"tracing": False})
    openapi.install(app, auth=bool(state.settings.key_tenants))
    app.state.router = state
    created = int(time.time())

    @app.exception_handler(OpenAIError)
    async def _openai_error(_request: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return OpenAIError(400, f"{loc}: {first.get('msg', 'invalid request')}" if loc else "invalid request",
                           param=loc or None).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return OpenAIError(exc.status_code, str(exc.detail), code=code,
                           headers=dict(exc.headers or {})).response()

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        return OpenAIError(500, "internal error in the router").response()

    def generation_route(path: str) -> None:
        api = HOT_ROUTES[path]

        async def generate(request: Request) -> Response:
            return await Generation(state, request, api).run()

        app.post(path, name=api.endpoint)(generate)

    for path in HOT_ROUTES:
        generation_route(path)

    @app.post("/v1/messages/count_tokens")
    async def messages_count_tokens(request: Request) -> JSONResponse:
        """Anthropic's token count of a Messages request: the prompt it would render to here."""
        try:
            authorize(state, request)
            body = Messages.validate(CountTokensRequest, await request.body())
            return JSONResponse({"input_tokens": count_tokens(state, body.model, conversation(body))})
        except OpenAIError as e:
            return JSONResponse(error_body(e), status_code=e.status, headers=e.headers)

    @app.delete("/v1/sessions/{session_id:path}")
    async def close_session(request: Request, session_id: str) -> JSONResponse:
        """Close a session (a subagent ended): every prefill frees the KV only it used, on its device and in
        the pool (shared/sessions.py). Idempotent; an unknown session frees nothing."""
        tenant = authorize(state, request)
        if not 1 <= len(session_id) <= MAX_SESSION_CHARS:
            raise OpenAIError(400, f"session id must be 1-{MAX_SESSION_CHARS} characters", param="session_id")
        await state.close_session(session_id, tenant)
        return JSONResponse({"id": session_id, "object": "session", "closed": True})

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        authorize(state, request)
        card = {"id": state.settings.model_name, "object": "model", "created": created, "owned_by": "moorage",
                "root": state.settings.model, "max_model_len": state.context_limit}
        return JSONResponse({"object": "list", "data": [card]})

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> JSONResponse:
        authorize(state, request)
        if model_id not in (state.settings.model_name, state.settings.model):
            raise OpenAIError(404, f"the model {model_id!r} does not exist", param="model", code="model_not_found")
        return JSONResponse({"id": state.settings.model_name, "object": "model", "created": created,
                             "owned_by": "moorage", "root": state.settings.model,
                             "max_model_len": state.context_limit})

    @app.get("/health")
    async def health() -> JSONResponse:
        now = state.clock()
        ready = {role: [v.instance for v in state.loads.fresh(role, now)] for role in REQUIRED_ROLES}
        missing = [role for role, instances in ready.items() if not instances]
        if missing:
            return JSONResponse({"status": "unavailable", "missing": missing, "ready": ready,
                                 "message": f"no ready {', '.join(missing)} instance reported in the last "
                                            f"{state.settings.instance_timeout_s:g} s"}, status_code=503)
        kv_tokens = {v.instance: v.capacity_tokens for role in ("prefill", "decode") for v in state.loads.fresh(role, now)}
        return JSONResponse({"status": "ok", "ready": ready, "kv_tokens": kv_tokens})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        if state.settings.metrics_require_key:
            authorize(state, request)
        return Response(state.metrics.render(), media_type=state.metrics.content_type)

    return app

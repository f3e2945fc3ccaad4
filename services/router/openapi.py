"""The router's published OpenAPI schema (GET /openapi.json).

FastAPI lists the routes; the generation endpoints read their raw body themselves (the API key is checked
first, and every error keeps its API's shape), so their request bodies are added here from the very
pydantic models that validate them, with the error object every failure returns (Anthropic's endpoints
answer errors in Anthropic's shape instead).
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from services.router.api_anthropic import CountTokensRequest, MessagesRequest
from services.router.api_responses import ResponsesRequest
from services.router.schemas import ChatCompletionRequest, CompletionRequest

BODIES = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest,
          "/v1/messages": MessagesRequest, "/v1/messages/count_tokens": CountTokensRequest,
          "/v1/responses": ResponsesRequest}
REF = "#/components/schemas/{model}"

ERROR_RESPONSE = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}},
    }},
}
_ERRORS = {"400": "invalid request (error.param names the field)", "401": "missing or unknown API key",
           "404": "unknown model", "413": "too large for the message bus", "429": "busy: retry after Retry-After",
           "503": "no instance can serve it now", "504": "timed out"}


def _responses() -> dict:
    error = {"application/json": {"schema": {"$ref": REF.format(model="ErrorResponse")}}}
    ok = {"application/json": {"schema": {"type": "object"}},
          "text/event-stream": {"schema": {"type": "string"}}}
    return {"200": {"description": "the completion (an SSE stream when stream=true)", "content": ok},
            **{code: {"description": why, "content": error} for code, why in _ERRORS.items()}}


def build(app: FastAPI, auth: bool) -> dict:
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes,
                         description="OpenAI-compatible completions served by moorage")
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components["ErrorResponse"] = ERROR_RESPONSE
    for path, model in BODIES.items():
        body = model.model_json_schema(ref_template=REF)
        components.update(body.pop("$defs", {}))
        components[model.__name__] = body
        op = schema["paths"][path]["post"]
        op["requestBody"] = {"required": True, "content": {
            "application/json": {"schema": {"$ref": REF.format(model=model.__name__)}}}}
        op["responses"] = _responses()
    if auth:
        schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        schema["security"] = [{"bearer": []}]
    return schema


def install(app: FastAPI, auth: bool) -> None:
    """Serve `build`'s schema, built once, from app.openapi_url."""
    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = build(app, auth)
        return app.openapi_schema

    app.openapi = openapi

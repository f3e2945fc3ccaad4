"""From an HTTP request to a Job, touching nothing but the request: API key (and its tenant), body, model
name, prompt token ids (chat template or raw prompt), context-length check, sampling parameters (with a
seed fixed here when the client sampled without one), and the size of the bus messages it will need.
Every failure is an OpenAIError with a 4xx status.
"""

from __future__ import annotations

import asyncio
import hmac
import secrets

from fastapi import Request
from pydantic import ValidationError

from services.router.dispatch import Job, RouterState
from services.router.schemas import ChatCompletionRequest, CompletionRequest, OpenAIError, from_validation_error
from shared.engine.sampling import SamplingParams
from shared.messages import PrefillSubmit

DEFAULT_TEMPERATURE = 1.0     # OpenAI's default
_TOKENIZE_IN_THREAD = 64 * 1024  # bodies larger than this are tokenized off the event loop
_BUS_ROOM = 4096  # bytes the request's bus messages may add to its PrefillSubmit (instance names, the
#                   handoff's own fields): a request that passes here fits every message it causes


def authorize(state: RouterState, request: Request) -> str:
    """The tenant of the request's API key: "" (the deployment's KV namespace) without keys or for a key
    of router.api_keys. A missing or unknown key is a 401. Every key is compared (no early exit)."""
    keys = state.settings.key_tenants
    if not keys:
        return ""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    token = token.strip().encode()
    tenant = None
    for key, name in keys.items():
        if hmac.compare_digest(token, key.encode()):
            tenant = name
    if scheme.lower() != "bearer" or tenant is None:
        raise OpenAIError(401, "invalid or missing API key (expected 'Authorization: Bearer <key>')",
                          code="invalid_api_key")
    return tenant


def check_bus_size(state: RouterState, job: Job, chat: bool) -> None:
    """413 when the request's PrefillSubmit (prompt ids packed, 4 bytes each) would not fit the bus."""
    cap = state.bus.max_message_bytes
    fixed = len(PrefillSubmit(job.request_id, [], job.sampling, "", job.session_id, job.tenant).encode())
    size = fixed + 5 + 4 * len(job.prompt_ids) + _BUS_ROOM
    if size > cap:
        where = "messages" if chat else "prompt"
        raise OpenAIError(413, f"This request is too large: it needs a {size}-byte message and the bus takes at "
                               f"most {cap} bytes (a prompt of up to about {(cap - fixed - _BUS_ROOM) // 4} "
                               f"tokens). Please reduce the length of the {where}.", param=where,
                          code="request_too_large")


def check_model(state: RouterState, model: str) -> None:
    if model not in (state.settings.model_name, state.settings.model):
        raise OpenAIError(404, f"the model {model!r} does not exist; this server serves "
                               f"{state.settings.model_name!r}", param="model", code="model_not_found")


def _prompt_ids(state: RouterState, body: ChatCompletionRequest | CompletionRequest) -> list[int]:
    tok = state.tokenizer
    if isinstance(body, ChatCompletionRequest):
        try:
            return tok.chat_token_ids(body.template_messages())
        except Exception as e:  # a template that rejects the conversation (e.g. role order)
            raise OpenAIError(400, f"messages could not be rendered with the chat template: {e}",
                              param="messages") from None
    prompt = body.prompt
    if isinstance(prompt, str):
        return tok.encode(prompt)
    if prompt and isinstance(prompt[0], str):
        return tok.encode(prompt[0])
    vocab = tok.vocab_size
    bad = next((t for t in prompt if not 0 <= t < vocab), None)
    if bad is not None:
        raise OpenAIError(400, f"prompt token id {bad} is outside the vocabulary [0, {vocab})", param="prompt")
    return list(prompt)


def _max_tokens(state: RouterState, requested: int | None, prompt_tokens: int, chat: bool) -> int:
    limit = state.context_limit
    room = limit - prompt_tokens
    max_tokens = requested if requested is not None else min(state.settings.default_max_tokens, room)
    if max_tokens < 1 or prompt_tokens + max_tokens > limit:
        where = "messages" if chat else "prompt"
        raise OpenAIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                               f"{prompt_tokens + max(max_tokens, 1)} tokens ({prompt_tokens} in the {where}, "
                               f"{max(max_tokens, 1)} in the completion). Please reduce the length of the "
                               f"{where} or completion.", param=where, code="context_length_exceeded")
    return max_tokens


async def prepare(state: RouterState, request: Request, chat: bool, request_id: str, session_id: str | None):
    """(Job, parsed body), or OpenAIError."""
    tenant = authorize(state, request)
    raw = await request.body()
    cls = ChatCompletionRequest if chat else CompletionRequest
    try:
        body = cls.model_validate_json(raw or b"null")
    except ValidationError as e:
        raise from_validation_error(e) from None
    check_model(state, body.model)
    if len(raw) > _TOKENIZE_IN_THREAD:
        prompt_ids = await asyncio.to_thread(_prompt_ids, state, body)
    else:
        prompt_ids = _prompt_ids(state, body)
    if not prompt_ids:
        raise OpenAIError(400, "the prompt is empty", param="prompt")
    max_tokens = _max_tokens(state, body.requested_max_tokens(), len(prompt_ids), chat)
    temperature = DEFAULT_TEMPERATURE if body.temperature is None else body.temperature
    seed = body.seed
    if seed is None and temperature > 0:
        seed = secrets.randbits(63)  # fixed here: prefill and decode sample from one stream
    sampling = dict(max_tokens=max_tokens, temperature=float(temperature),
                    top_p=1.0 if body.top_p is None else float(body.top_p), seed=seed,
                    stop=body.stop_list(), stop_token_ids=[], ignore_eos=bool(body.ignore_eos))
    try:
        SamplingParams(**{**sampling, "stop": tuple(sampling["stop"])})
    except ValueError as e:
        raise OpenAIError(400, str(e)) from None
    job = Job(request_id, session_id, prompt_ids, max_tokens, sampling, tenant=tenant)
    check_bus_size(state, job, chat)
    return job, body

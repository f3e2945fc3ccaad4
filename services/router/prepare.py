"""From an HTTP request to a Job, touching nothing but the request: API key (and its tenant), body, model
name, prompt token ids (chat template or raw prompt), context-length check, sampling parameters (with a
seed fixed here when the client sampled without one), and the size of the bus messages it will need.
Every failure is an OpenAIError with a 4xx status.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import secrets

from fastapi import Request

from services.router.api import Api, Parsed, Prepared
from services.router.conversation import Conversation, render_prompt
from services.router.dispatch import Job, RouterState
from services.router.hints import HEADER, resolve
from services.router.schemas import OpenAIError
from shared.engine.sampling import SamplingParams
from shared.messages import PrefillSubmit

DEFAULT_TEMPERATURE = 1.0     # OpenAI's default
_TOKENIZE_IN_THREAD = 64 * 1024  # bodies larger than this are tokenized off the event loop
_BUS_ROOM = 4096  # bytes the request's bus messages may add to its PrefillSubmit (instance names, the
#                   handoff's own fields): a request that passes here fits every message it causes


def authorize(state: RouterState, request: Request) -> str:
    """The tenant of the request's API key (`Authorization: Bearer`, else `x-api-key`): "" (the deployment's KV
    namespace) without keys or for a key of router.api_keys. A missing or unknown key is a 401. Every key is
    compared (no early exit)."""
    keys = state.settings.key_tenants
    if not keys:
        return ""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer":  # Anthropic's clients send x-api-key
        token = request.headers.get("x-api-key", "")
    token = token.strip().encode()
    tenant = None
    for key, name in keys.items():
        if hmac.compare_digest(token, key.encode()):
            tenant = name
    if tenant is None:
        raise OpenAIError(401, "invalid or missing API key (expected 'Authorization: Bearer <key>' or "
                               "'x-api-key: <key>')", code="invalid_api_key")
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


def _prompt_ids(state: RouterState, parsed: Parsed) -> list[int]:
    tok = state.tokenizer
    if parsed.conversation is not None:
        return tok.encode(render_prompt(tok, parsed.conversation, state.tool_format))
    prompt = parsed.prompt
    if isinstance(prompt, str):
        return tok.encode(prompt)
    if prompt and isinstance(prompt[0], str):
        return tok.encode(prompt[0])
    vocab = tok.vocab_size
    bad = next((t for t in prompt if not 0 <= t < vocab), None)
    if bad is not None:
        raise OpenAIError(400, f"prompt token id {bad} is outside the vocabulary [0, {vocab})", param="prompt")
    return list(prompt)


def conversation_key(conv: Conversation | None) -> str | None:
    """A session name for a client that gives none: the conversation's opening (every turn up to and
    including the first user turn), which each later turn of the same conversation repeats, and which two
    sessions of one agent (same system prompt and tools) do not share."""
    if conv is None:
        return None
    first_user = next((i for i, m in enumerate(conv.messages) if m["role"] == "user"), len(conv.messages) - 1)
    opening = json.dumps([[m["role"], m.get("content")] for m in conv.messages[:first_user + 1]], ensure_ascii=False)
    return "conv-" + hashlib.blake2b(opening.encode(), digest_size=12).hexdigest()


def _max_tokens(state: RouterState, requested: int | None, prompt_tokens: int, chat: bool,
                clamp: bool = False) -> int:
    """The request's max_tokens; past the context, a 400 (or, with `clamp`, the room left when there is some)."""
    limit = state.context_limit
    room = limit - prompt_tokens
    max_tokens = requested if requested is not None else min(state.settings.default_max_tokens, room)
    if clamp and room >= 1:
        max_tokens = min(max_tokens, room)
    if max_tokens < 1 or prompt_tokens + max_tokens > limit:
        where = "messages" if chat else "prompt"
        raise OpenAIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                               f"{prompt_tokens + max(max_tokens, 1)} tokens ({prompt_tokens} in the {where}, "
                               f"{max(max_tokens, 1)} in the completion). Please reduce the length of the "
                               f"{where} or completion.", param=where, code="context_length_exceeded")
    return max_tokens


def count_tokens(state: RouterState, model: str, conv: Conversation) -> int:
    """The prompt tokens a conversation renders to (Anthropic's count_tokens)."""
    check_model(state, model)
    conv.check()
    return len(_prompt_ids(state, Parsed(model, conversation=conv)))


def _prompt_and_grammar(state: RouterState, parsed: Parsed) -> tuple[list[int], str]:
    conv = parsed.conversation
    if conv is not None:
        conv.check()
    grammar = state.guidance.grammar(conv, state.tool_format) if conv is not None else ""
    return _prompt_ids(state, parsed), grammar


async def prepare(state: RouterState, request: Request, api: Api, request_id: str,
                  session_id: str | None) -> tuple[Job, Prepared]:
    """(Job, Prepared), or OpenAIError. `session_id`: the one the headers named, if any; else the body's,
    else the conversation's opening (conversation_key)."""
    tenant = authorize(state, request)
    raw = await request.body()
    parsed = api.parse(raw)
    check_model(state, parsed.model)
    if len(raw) > _TOKENIZE_IN_THREAD:
        prompt_ids, grammar = await asyncio.to_thread(_prompt_and_grammar, state, parsed)
    else:
        prompt_ids, grammar = _prompt_and_grammar(state, parsed)
    if not prompt_ids:
        raise OpenAIError(400, "the prompt is empty", param="prompt")
    max_tokens = _max_tokens(state, parsed.max_tokens, len(prompt_ids), api.chat, api.clamps_max_tokens)
    temperature = DEFAULT_TEMPERATURE if parsed.temperature is None else parsed.temperature
    seed = parsed.seed
    if seed is None and temperature > 0:
        seed = secrets.randbits(63)  # fixed here: prefill and decode sample from one stream
    try:
        sampling = SamplingParams(max_tokens=max_tokens, temperature=float(temperature),
                                  top_p=1.0 if parsed.top_p is None else float(parsed.top_p), seed=seed,
                                  stop=tuple(parsed.stop), ignore_eos=bool(parsed.ignore_eos), grammar=grammar,
                                  logprobs=parsed.logprobs)
    except ValueError as e:
        raise OpenAIError(400, str(e)) from None
    conv = parsed.conversation
    session = session_id or parsed.session_hint or conversation_key(conv)
    hints = resolve(parsed.hints, request.headers.get(HEADER), state.settings.priority_ceiling(tenant))
    job = Job(request_id, session, prompt_ids, sampling, tenant=tenant, priority=hints.priority,
              latency_s=hints.latency_s, osl=hints.osl, close_session=hints.close_session)
    check_bus_size(state, job, api.chat)
    reads_calls = conv is not None and conv.tools and conv.tool_choice.mode != "none"
    return job, Prepared(parsed, len(prompt_ids), state.tool_format if reads_calls else None,
                         conv.names if reads_calls else frozenset(),
                         state.tokenizer if parsed.logprobs is not None else None)

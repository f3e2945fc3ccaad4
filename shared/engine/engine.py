"""The engine prefill and decode instances share: model + paged KV + block manager + scheduler.

Scheduler-facing life of a request: add -> (match prefix -> allocate -> compute -> register full
blocks)* -> sample -> ... -> finish (release). Other owners of a sequence's blocks (an async save, a
handoff in flight) call `block_manager.acquire/release` themselves; a block returns to the free pool
only when its last owner lets go.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from shared.engine.block_manager import BlockManager
from shared.engine.decode_graphs import DecodeGraphs
from shared.engine.guide import GuideError, Guides
from shared.engine.kv_sizing import parse_memory, size_kv
from shared.engine.page_warmer import PageWarmer
from shared.engine.model import LlamaModel
from shared.engine.models import LoadedModel
from shared.engine.runner import ModelRunner
from shared.engine.sampling import SamplingParams, TokenLogprob, sample, token_logprobs
from shared.engine.scheduler import EngineStats, ScheduledBatch, SchedulePolicy, Scheduler
from shared.engine.sequence import Sequence
from shared.engine.stopping import check_stop
from shared.hashing import BLOCK_TOKENS, namespace_seed
from shared.kv_events import KVEvent
from shared.kv_layout import KVLayout, allocate_pages
from shared.kv_tenant import KVNamespace
from shared.logging import get_logger

log = get_logger("engine")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class EngineConfig:
    model: str = "smollm2-135m"       # what services load (`Engine` itself takes a loaded model)
    num_blocks: int = 0               # KV capacity = num_blocks * block_size tokens; 0 = sized by kv_memory
    kv_memory: str = "auto"           # when num_blocks is 0: "40%" of the memory free after the model loads, a size ("6GiB"), or auto (40%; `moorage up` splits the host)
    stages: int = 1                   # pipeline stages the KV pool is split into
    pp: int = 1                       # pipeline ranks: one process per stage (stages = pp), shared/engine/pipeline.py; prefill sets it from prefill.pp
    dcp: int = 1                      # context-parallel ranks: rank r holds tokens t % dcp == r (shared/engine/context_parallel.py); decode sets it from decode.dcp
    max_batched_tokens: int = 2048    # prefill tokens per step (chunked prefill)
    max_num_seqs: int = 32            # sequences running at once (continuous batching width)
    schedule: str = "srpf"            # prefill order: srpf (shortest remaining prefill first, aged) or fcfs
    long_prefill_tokens: int = 256    # srpf: most tokens one prompt computes per step, so steps stay short (0 = max_batched_tokens)
    schedule_aging_s: float = 30.0    # srpf: a prompt's remaining tokens count half after waiting this long (no starvation)
    priority_step_tokens: int = 512   # srpf: within priority_window_s of a prompt with priority > 0 (agent hints), the others compute at most this many tokens per step in all, so the next priority prompt waits for a short step at most (0 = off; priority prompts are not held to it)
    priority_window_s: float = 60.0   # srpf: how long after the last priority prompt arrived steps stay that short
    device: str = "cpu"               # torch device
    dtype: str = "float32"            # compute dtype
    kv_dtype: str | None = None       # defaults to dtype
    enable_prefix_cache: bool = True  # reuse full blocks of earlier prompts from device memory
    retained_fraction: float = 1.0    # most of the KV blocks that finished requests' cached blocks may keep (the rest are evicted LRU at once); they are free KV to the gate and to new requests either way (decode: what a session's next turn is not sent again)
    tenant_salt: str = ""             # mixed into the KV namespace: tenants never share KV
    chunk_tokens: int = 256           # tokens per pool object (a multiple of 16); part of the KV namespace
    record_prompt_logits: bool = False  # keep the logits that chose each first token (tests)
    cuda_graphs: bool = False         # decode steps replayed from CUDA graphs, per (batch, table width) bucket (shared/engine/decode_graphs.py); on CPU the same padded batches run eagerly
    cuda_graphs_ahead: bool = True    # with cuda_graphs: record every bucket when the engine starts (largest first), so no step in service pays a recording or a Triton compile; false: each on the first step that needs it
    kv_warm_ahead: str = "512MiB"     # CPU: keep this much KV (a size, or a share of the pool: "10%") beyond the blocks used so far resident, faulted in by a native thread at nice 19 (idle CPU); "0" = off (first writes then page-fault)

    def __post_init__(self) -> None:
        warm_ahead_bytes(self.kv_warm_ahead, 1)  # raises ValueError on a bad value
        if self.pp < 1:
            raise ValueError(f"pp must be >= 1, got {self.pp}")
        if self.pp > 1:
            if self.stages not in (1, self.pp):
                raise ValueError(f"engine.stages ({self.stages}) must equal pp ({self.pp}): a rank holds one stage")
            self.stages = self.pp
        if self.dcp < 1 or BLOCK_TOKENS % self.dcp:
            raise ValueError(f"dcp must divide the block size {BLOCK_TOKENS} (1, 2, 4, 8 or 16), got {self.dcp}")
        if self.dcp > 1 and (self.pp > 1 or self.stages > 1):
            raise ValueError("dcp > 1 holds every layer on every rank: pp and stages stay 1")
        if self.pp > 1 or self.dcp > 1:
            if self.device != "cpu":
                raise ValueError(f"pp or dcp > 1 runs its ranks on the CPU only so far (engine.device={self.device!r}): "
                                 "a rank's own transfer and pool endpoints for device pages are not built yet")
            if self.cuda_graphs:
                raise ValueError("cuda_graphs with pp or dcp > 1: decode graphs replay one process's whole model")
        if not 0.0 <= self.retained_fraction <= 1.0:
            raise ValueError(f"engine.retained_fraction must be in [0, 1], got {self.retained_fraction}")


def warm_ahead_bytes(spec: str, pool_bytes: int) -> int:
    """engine.kv_warm_ahead in bytes, for a pool of pool_bytes."""
    if str(spec).strip().lower() in ("0", "off"):
        return 0
    try:
        return parse_memory(spec).resolve(pool_bytes)
    except ValueError as e:
        raise ValueError(f"engine.kv_warm_ahead: {e}") from None


@dataclass
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None  # one per new token, when the request asked (params.logprobs)


class GuideFailed(NamedTuple):
    request_id: str
    message: str


class StepFailed(Exception):
    """A step raised while computing or sampling its batch. Its requests are aborted (their blocks
    released, retained ones included) and named here; the engine itself goes on."""

    def __init__(self, request_ids: list[str], cause: BaseException):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.request_ids, self.cause = request_ids, cause


class Engine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None,
                 on_kv_event: Callable[[KVEvent], None] | None = None):
        self.config = cfg = config or EngineConfig()
        self.loaded, self.tokenizer = loaded, loaded.tokenizer
        mc = loaded.config
        if cfg.pp > mc.num_layers:
            raise ValueError(f"prefill.pp = {cfg.pp}: more pipeline ranks than the model's {mc.num_layers} layers")
        self.layout = KVLayout(mc.num_layers, mc.num_kv_heads, mc.head_dim,
                               dtype=_DTYPES[cfg.kv_dtype or cfg.dtype], stages=cfg.stages,
                               chunk_tokens=cfg.chunk_tokens)
        self.namespace = self.layout.fingerprint(loaded.model_id, cfg.tenant_salt)
        self.model = LlamaModel(mc, loaded.weights, self.layout, cfg.device, _DTYPES[cfg.dtype],
                                layers=self.layout.stage_layers(0) if cfg.pp > 1 else None)
        # sized after the model is in memory, so a share of what is free counts what it took
        self.kv_sizing = size_kv(cfg.num_blocks, cfg.kv_memory, self.layout.block_size * self.layout.bytes_per_token,
                                 cfg.device)
        self.config = cfg = replace(cfg, num_blocks=self.kv_sizing.num_blocks)
        log.info("kv cache", blocks=cfg.num_blocks, tokens=self.kv_sizing.tokens(self.layout.block_size),
                 gib=round(self.kv_sizing.bytes / (1 << 30), 3), sized_by=self.kv_sizing.how)
        # decode graphs: one page past the block manager's for the padded rows (see decode_graphs.py)
        self.pipeline = None  # StageGroup: ranks 1..pp-1 (pp > 1)
        self.context = None   # DcpGroup: ranks 1..dcp-1 (dcp > 1)
        if cfg.dcp > 1:
            from shared.engine.context_parallel import rank_pages

            self.pages = rank_pages(self.layout, cfg.dcp, cfg.num_blocks)  # rank r's page: its 1/dcp of each block
        elif cfg.pp > 1:
            from shared.engine.pipeline import shared_pages

            self.pages = shared_pages(self.layout, cfg.num_blocks)
        else:
            self.pages = allocate_pages(self.layout, cfg.num_blocks + (1 if cfg.cuda_graphs else 0), cfg.device)
        self.block_manager = BlockManager(cfg.num_blocks, self.layout.block_size, namespace_seed(self.namespace),
                                          on_kv_event, int(cfg.num_blocks * cfg.retained_fraction))
        block_bytes = self.layout.block_size * self.layout.bytes_per_token
        self.page_warmer = PageWarmer(self.pages, warm_ahead_bytes(cfg.kv_warm_ahead, self.kv_sizing.bytes) // block_bytes)
        self.block_manager.on_allocate = self.page_warmer.allocated
        self.scheduler = Scheduler(self.block_manager, cfg.max_batched_tokens, cfg.max_num_seqs,
                                   cfg.enable_prefix_cache, SchedulePolicy.from_config(cfg))
        graphs = DecodeGraphs(self.model, self.pages, self.layout.block_size, cfg.num_blocks, cfg.max_num_seqs,
                              mc.max_context) if cfg.cuda_graphs else None
        if cfg.dcp > 1:
            from shared.engine.context_parallel import DcpGroup, DcpRunner

            self.context = DcpGroup(self.layout, cfg.dcp, self.pages, mc.num_heads, self.model.scale,
                                    self.model.windows)
            self.runner = DcpRunner(self.model, self.pages, self.layout.block_size, self.context)
        elif cfg.pp > 1:
            from shared.engine.pipeline import PipelineRunner, StageGroup

            self.pipeline = StageGroup(mc, loaded.weights, self.layout, self.pages, cfg.device, _DTYPES[cfg.dtype])
            self.runner = PipelineRunner(self.model, self.pages, self.layout.block_size, self.pipeline)
        else:
            self.runner = ModelRunner(self.model, self.pages, self.layout.block_size, graphs)
        if graphs is not None and cfg.cuda_graphs_ahead:
            graphs.record_all()
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids or mc.eos_token_ids)
        self.sequences: dict[str, Sequence] = {}
        self.guides = Guides(self.tokenizer, mc.vocab_size)  # constrained decoding (llguidance, built on first use)
        self.guide_failures: list[GuideFailed] = []  # requests a grammar ended in a step (taken by the loop)
        self.stalled = False
        self.lock = threading.RLock()  # see step(): what may change while a forward pass runs
        # Called (from the stepping thread, before the forward pass) with the ids of the prefill-only
        # requests whose prompt the step about to run completes: prefill asks decode for their pages
        # while it computes (services/prefill/main.py). None: nobody listens.
        self.on_prefill_ending: Callable[[list[str]], None] | None = None

    @property
    def ranks_lost(self) -> str | None:
        """Why this engine's rank group ended (a rank exited), or None: it can run no more steps."""
        return next((g.lost for g in (self.pipeline, self.context) if g is not None and g.lost), None)

    def close(self) -> None:
        """Stops what the engine started outside this process (pipeline or context-parallel ranks). Idempotent."""
        for group in (self.pipeline, self.context):
            if group is not None:
                group.close()

    @property
    def stats(self) -> EngineStats:
        return self.scheduler.stats

    @property
    def kv_capacity_tokens(self) -> int:
        return self.config.num_blocks * self.layout.block_size

    def kv_namespace(self, tenant: str = "") -> KVNamespace:
        """A tenant's KV namespace: its prefix cache entries and pool objects are its own."""
        return KVNamespace.of(self.namespace, tenant)

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    retain_kv: bool = False, prefill_only: bool = False, pinned_blocks: list[int] = (),
                    restored_range: tuple[int, int] = (0, 0), tenant: str = "", priority: int = 0) -> Sequence:
        """Queue a request. `retain_kv`: on finish its block table passes to the caller. `prefill_only`:
        finish after the first token; if that token did not end the request, the reason is
        "prefilled" and the block table passes to the caller (for the handoff). `pinned_blocks`: one
        reference the caller gives up once the request is admitted (or rejected here). `tenant`: its
        prefix cache entries are matched and registered under that tenant's namespace only. `priority`:
        higher first in srpf order (scheduler.priority_weight)."""
        try:
            self._validate(request_id, prompt_ids, params)
        except ValueError:
            self.block_manager.release(reversed(list(pinned_blocks)))
            raise
        try:
            guide = self.guides.matcher(params.grammar) if params.grammar else None
        except GuideError:
            self.block_manager.release(reversed(list(pinned_blocks)))
            raise
        seq = Sequence(request_id, list(prompt_ids), params, retain_kv=retain_kv, prefill_only=prefill_only,
                       pinned_blocks=list(pinned_blocks), restored_range=restored_range,
                       hash_seed=self.kv_namespace(tenant).seed if tenant else None, guide=guide,
                       priority=priority)
        self.sequences[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def adopt_prefilled(self, request_id: str, prompt_ids: list[int], output_ids: list[int],
                        params: SamplingParams, block_table: list[int], shown_text: str = "",
                        priority: int = 0, tenant: str = "") -> Sequence:
        """Continue a request whose KV arrived from elsewhere (a handoff): KV of every token but the
        last output token is already in `block_table`, whose ownership passes to the sequence.
        `shown_text` is what the client has already been sent, so deltas continue from it. `priority`
        (higher first): when KV runs out, lower priorities are preempted first. Only the prompt's full blocks
        (the KV that landed, verified) enter the prefix index, under `tenant`'s namespace: a later request's
        handoff may reuse them (services/decode/direct.py); blocks this engine decodes never do."""
        self._validate(request_id, prompt_ids, params)
        if not output_ids:
            raise ValueError("a prefilled request carries at least its first output token")
        guide = self.guides.matcher(params.grammar, output_ids) if params.grammar else None  # replayed: see guide.py
        seq = Sequence(request_id, list(prompt_ids), params, token_ids=list(prompt_ids) + list(output_ids),
                       guide=guide, priority=priority, hash_seed=self.kv_namespace(tenant).seed if tenant else None,
                       register_limit=len(prompt_ids) // self.layout.block_size)
        seq.num_computed = len(seq.token_ids) - 1
        if len(block_table) * self.layout.block_size < seq.num_computed:
            raise ValueError(f"block table holds {len(block_table)} blocks, too few for {seq.num_computed} tokens")
        seq.block_table = list(block_table)
        seq.output_text = shown_text
        self._register_full_blocks(seq)
        self.sequences[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def _validate(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        if request_id in self.sequences:
            raise ValueError(f"request id {request_id!r} already active")
        self.check_request(prompt_ids, params)

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """What can be known about a request before it is queued (pure: safe from any thread)."""
        if not prompt_ids:
            raise ValueError("prompt must contain at least one token")
        vocab = self.loaded.config.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        total = len(prompt_ids) + params.max_tokens
        if total > self.loaded.config.max_context:
            raise ValueError(f"this model's maximum context length is {self.loaded.config.max_context} tokens; "
                             f"the prompt ({len(prompt_ids)}) plus max_tokens ({params.max_tokens}) is {total}")
        if total > self.kv_capacity_tokens:
            raise ValueError(f"prompt plus max_tokens ({total}) exceeds this engine's KV capacity "
                             f"({self.kv_capacity_tokens} tokens)")

    def abort(self, request_id: str) -> None:
        seq = self.sequences.pop(request_id, None)
        if seq is not None and not seq.is_finished:
            self.scheduler.finish(seq, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[StepOutput]:
        """One scheduled batch. Raises StepFailed (its requests aborted) if computing it fails. The
        books (scheduler, block manager, sequences) change only under `lock`; the forward pass itself
        runs without it, touching only the pages of the batch's own blocks."""
        with self.lock:
            batch = self.scheduler.schedule()
            self.stalled = batch is None and self.scheduler.has_work()  # waiting for blocks held elsewhere
        if batch is None:
            return []
        if self.on_prefill_ending is not None:
            ending = [s.request_id for s, n in zip(batch.seqs, batch.num_tokens)
                      if s.prefill_only and s.num_computed + n >= len(s.token_ids)]
            if ending:
                self.on_prefill_ending(ending)
        guided = [s for s, n in zip(batch.seqs, batch.num_tokens)
                  if s.guide is not None and s.num_computed + n == len(s.token_ids)]  # they sample this step
        masks = self.guides.start_masks([s.guide for s in guided]) if guided else None  # beside the forward pass
        try:
            samplers, logits = self.runner.run(batch)
            # the rows whose requests asked for log-probabilities, copied before a grammar masks them
            asked = [r for r, i in enumerate(samplers) if batch.seqs[i].params.logprobs is not None]
            raw = logits[asked] if asked else None
            if masks is not None:
                rows = {id(batch.seqs[i]): r for r, i in enumerate(samplers)}
                self.guides.apply(logits, [rows[id(s)] for s in guided], masks.result())
            with self.lock:
                return self._finish_batch(batch, samplers, logits, asked, raw)
        except Exception as e:
            with self.lock:
                raise StepFailed(self._abort_batch(batch), e) from e

    def _abort_batch(self, batch: ScheduledBatch) -> list[str]:
        """Ends every sequence of a failed batch and releases its blocks. A sequence the batch already
        finished kept its blocks for the caller (retain_kv, "prefilled"), but the caller never saw that
        output: its blocks are released here too. Returns the request ids."""
        failed = []
        for seq in batch.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
            elif seq.block_table:
                self.block_manager.release(reversed(seq.block_table))
                seq.block_table = []
            self.sequences.pop(seq.request_id, None)
            failed.append(seq.request_id)
        return failed

    def _finish_batch(self, batch: ScheduledBatch, samplers: list[int], logits, asked: list[int],
                      raw) -> list[StepOutput]:
        """Samples the rows that finished their tokens; `raw`: the unmasked logits of the rows `asked`
        (indices into samplers) whose requests want log-probabilities."""
        for seq, n in zip(batch.seqs, batch.num_tokens):
            seq.num_computed += n
            self._register_full_blocks(seq)
        if not samplers:
            return []
        seqs = [batch.seqs[i] for i in samplers]
        tokens = sample(logits, [s.params for s in seqs], [s.next_generator(logits.device) for s in seqs])
        lps = dict(zip(asked, token_logprobs(raw, [tokens[r] for r in asked],
                                             [seqs[r].params.logprobs for r in asked]))) if asked else {}
        outputs = []
        for row, (seq, token) in enumerate(zip(seqs, tokens)):
            if not seq.output_ids:
                seq.first_token_ns = time.time_ns()
                if self.config.record_prompt_logits:
                    seq.prompt_logits = logits[row].clone()
            seq.token_ids.append(token)
            if row in lps:
                seq.output_logprobs.append(lps[row])
            if seq.guide is not None and not self._guide_accepts(seq, token):
                continue
            old_text = seq.output_text
            reason = check_stop(seq, self.tokenizer, self.eos_token_ids)
            if reason is None and seq.prefill_only:
                reason = "prefilled"
            if reason is not None:
                self.scheduler.finish(seq, reason)
                self.sequences.pop(seq.request_id, None)
            outputs.append(StepOutput(seq.request_id, [token], seq.output_text[len(old_text):],
                                      reason is not None, reason, [lps[row]] if row in lps else None))
        return outputs

    def _guide_accepts(self, seq: Sequence, token: int) -> bool:
        """Advance the request's grammar by its new token. A refusal (a bug: the mask allowed it) ends that
        request only: aborted, its KV released, and named in `guide_failures` for the loop to report."""
        try:
            self.guides.consume(seq.guide, token)
            return True
        except GuideError as e:
            self.scheduler.finish(seq, "abort")
            self.sequences.pop(seq.request_id, None)
            self.guide_failures.append(GuideFailed(seq.request_id, str(e)))
            return False

    def take_guide_failures(self) -> list[GuideFailed]:
        failures, self.guide_failures = self.guide_failures, []
        return failures

    def _register_full_blocks(self, seq: Sequence) -> None:
        full = seq.num_computed // self.layout.block_size
        if seq.register_limit >= 0:
            full = min(full, seq.register_limit)
        if full > seq.num_registered_blocks:
            self.block_manager.register_full_blocks(seq.block_table, seq.token_ids, full,
                                                    start_block=seq.num_registered_blocks, seed=seq.hash_seed)
            seq.num_registered_blocks = full

    def generate(self, prompts: Iterable[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Sequence]:
        """Run prompts to completion (offline use and tests). Returns finished sequences in order."""
        prompts = list(prompts)
        plist = params if isinstance(params, list) else [params] * len(prompts)
        base = len(self.sequences) + id(prompts)
        seqs = [self.add_request(f"gen-{base}-{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, plist))]
        while any(not s.is_finished for s in seqs):
            self.step()
            if self.stalled:
                raise RuntimeError("engine stalled: no KV blocks free for any waiting request")
        return seqs

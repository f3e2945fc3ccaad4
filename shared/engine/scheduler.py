"""Chooses what the next engine step computes: a chunked-prefill batch, else one decode token each.

Prefill comes first and is bounded by `max_batched_tokens` per step, so a long prompt is computed in
several steps (chunked prefill). Which prompts share a step is the policy's choice:
- fcfs: prompts already being chunked continue first, then waiting ones in arrival order; one cold
  prompt may take a whole step, and every request behind it waits for its whole prompt.
- srpf (shortest remaining prefill first): every prompt with tokens left competes by the tokens it
  still has to compute, discounted by how long it has waited (`aging_s`: a prompt that waited that long
  counts half), and none computes more than `long_prefill_tokens` per step. So a returning turn whose
  history is cached waits at most one short step behind another session's cold prompt, and the cold
  prompt still progresses with the budget left over. Agent hints: a prompt with priority > 0 weighs less
  (priority_weight), is not capped, and runs without lower prompts in its step; and for
  `priority_window_s` after one arrived, the other prompts get at most `priority_step_tokens` a step in
  all, so the next one waits for a short step at most (bench/priority.py: 2.3x its unloaded TTFT under
  overload with 2048-token steps, 1.5x with 512; no priority traffic, no change).
A waiting sequence is admitted by matching its longest cached prefix in the device prefix index (those
blocks get one more owner and are not recomputed), then allocating blocks only for the tokens this
step computes. When decode runs out of blocks, the newest running sequence of the lowest priority (agent
hints) is preempted: its blocks are released (still cached) and it is recomputed later, mostly from the
prefix cache. Nothing here touches
tensors.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from shared.engine.block_manager import BlockManager, OutOfBlocks
from shared.engine.sequence import Sequence, SeqStatus


@dataclass
class EngineStats:
    """Cumulative counters; tests use them to prove a cache hit skipped compute."""
    prefill_steps: int = 0
    decode_steps: int = 0
    prefill_tokens_computed: int = 0
    decode_tokens_computed: int = 0
    device_cached_tokens: int = 0  # prompt tokens taken from the device prefix cache at admission
    preemptions: int = 0


@dataclass
class ScheduledBatch:
    is_prefill: bool
    seqs: list[Sequence]
    num_tokens: list[int]  # new tokens computed per sequence this step


@dataclass(frozen=True)
class SchedulePolicy:
    kind: str = "fcfs"              # fcfs | srpf
    long_prefill_tokens: int = 0    # srpf: per-prompt tokens per step (0 = no cap beyond the budget); a prompt with priority > 0 is not capped
    aging_s: float = 30.0           # srpf: waiting this long halves a prompt's remaining-token count
    priority_step_tokens: int = 0   # srpf: while priority traffic is recent, prompts of priority <= 0 compute at most this many tokens per step in all (0 = off)
    priority_window_s: float = 60.0  # srpf: how long after the last prompt with priority > 0 arrived that holds

    def __post_init__(self) -> None:
        if self.kind not in ("fcfs", "srpf"):
            raise ValueError(f"engine.schedule must be fcfs or srpf, got {self.kind!r}")
        if self.long_prefill_tokens < 0 or self.aging_s <= 0:
            raise ValueError("engine.long_prefill_tokens must be >= 0 and engine.schedule_aging_s > 0")
        if self.priority_step_tokens < 0 or self.priority_window_s < 0:
            raise ValueError("engine.priority_step_tokens and engine.priority_window_s must be >= 0")

    @classmethod
    def from_config(cls, cfg) -> "SchedulePolicy":
        return cls(cfg.schedule, cfg.long_prefill_tokens, cfg.schedule_aging_s, cfg.priority_step_tokens,
                   cfg.priority_window_s)


def priority_weight(priority: int) -> float:
    """How much sooner a priority makes a prompt in srpf order: 1 + p for p > 0 (priority 10: as if it had 11x
    fewer tokens left), 1 / (1 - p) below 0. Bounded by the router's ceiling, and aging still halves a waiting
    prompt's count per aging_s, so a low priority waits longer but never for ever."""
    return 1.0 + priority if priority >= 0 else 1.0 / (1.0 - priority)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_batched_tokens: int, max_num_seqs: int,
                 enable_prefix_cache: bool = True, policy: SchedulePolicy | None = None,
                 clock_ns: Callable[[], int] = time.time_ns):
        self.bm = block_manager
        self.block_size = block_manager.block_size
        self.max_batched_tokens = max_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.enable_prefix_cache = enable_prefix_cache
        self.policy = policy or SchedulePolicy()
        self.clock_ns = clock_ns  # the same clock as Sequence.arrival_ns
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.stats = EngineStats()
        self._cached_estimate: dict[Sequence, int] = {}  # srpf: device-cached prefix of a waiting prompt
        self.last_priority_ns: int | None = None  # when the latest prompt with priority > 0 arrived

    def add(self, seq: Sequence) -> None:
        if seq.priority > 0:
            self.last_priority_ns = self.clock_ns()
        self.waiting.append(seq)

    def _low_budget(self, now_ns: int, budget: int) -> int:
        """Prompt tokens a step may give prompts of priority <= 0: all of it, or `priority_step_tokens` while
        priority traffic is recent (a prompt with priority > 0 then waits for a short step at most)."""
        p = self.policy
        if p.priority_step_tokens and self.last_priority_ns is not None \
                and now_ns - self.last_priority_ns <= p.priority_window_s * 1e9:
            return min(budget, p.priority_step_tokens)
        return budget

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch | None:
        batch = self._schedule_once()
        if batch is None and any(s.pinned_blocks for s in self.waiting):
            # Nothing can run, and queued requests hold pins: a pin is an optimisation, never a
            # right, so give them up rather than stall the requests ahead of them.
            for seq in self.waiting:
                self._unpin(seq)
            batch = self._schedule_once()
        if batch is not None:
            st, n = self.stats, sum(batch.num_tokens)
            if batch.is_prefill:
                st.prefill_steps, st.prefill_tokens_computed = st.prefill_steps + 1, st.prefill_tokens_computed + n
            else:
                st.decode_steps, st.decode_tokens_computed = st.decode_steps + 1, st.decode_tokens_computed + n
        return batch

    def _schedule_once(self) -> ScheduledBatch | None:
        batch = self._schedule_srpf() if self.policy.kind == "srpf" else self._schedule_prefill()
        return batch if batch.seqs else self._schedule_decode()

    # ---- srpf --------------------------------------------------------------------------------------
    def _schedule_srpf(self) -> ScheduledBatch:
        batch = ScheduledBatch(True, [], [])
        budget = self.max_batched_tokens
        cap = self.policy.long_prefill_tokens or budget
        now = self.clock_ns()
        prompts = [s for s in self.running if s.num_uncomputed > 1] + list(self.waiting)
        lead = None  # once a prompt with priority > 0 is in, the step takes no lower one: it stays short
        low = self._low_budget(now, budget)
        for seq in sorted(prompts, key=lambda s: self._priority(s, now)):
            if budget == 0:
                break
            if (lead is not None and seq.priority < lead) or (seq.priority <= 0 and low == 0):
                continue
            limit = min(cap, low) if seq.priority <= 0 else budget  # a priority prompt is not capped per step
            if seq.status is SeqStatus.WAITING:
                if len(self.running) >= self.max_num_seqs:
                    continue
                self._admit_prefix(seq)
                n = min(seq.num_uncomputed, budget, limit)  # after _admit_prefix: a hit shortens it
                if not self._try_grow(seq, n):
                    self._drop_blocks(seq)  # retry later, when blocks are free; shorter ones may fit...
                    if now - seq.arrival_ns >= self.policy.aging_s * 1e9:
                        break  # ...unless it has waited long: then nobody newer takes the blocks it needs
                    continue
                self.waiting.remove(seq)
                self._cached_estimate.pop(seq, None)
                seq.first_scheduled_ns = seq.first_scheduled_ns or now
                seq.status = SeqStatus.RUNNING
                self.running.append(seq)
            else:
                n = min(seq.num_uncomputed, budget, limit)
                if not self._try_grow(seq, n):
                    continue
            batch.seqs.append(seq), batch.num_tokens.append(n)
            budget -= n
            low -= n if seq.priority <= 0 else 0
            lead = seq.priority if lead is None and seq.priority > 0 else lead
        return batch

    def _priority(self, seq: Sequence, now_ns: int) -> tuple[float, int]:
        """Smaller first: tokens still to compute, halved per `aging_s` waited and divided by the request's
        priority weight; ties in arrival order."""
        remaining = seq.num_uncomputed
        if seq.status is SeqStatus.WAITING and not seq.block_table and self.enable_prefix_cache:
            cached = self._cached_estimate.get(seq)
            if cached is None:  # a read-only look, once: ordering needs an estimate, not a promise
                cached = self.bm.match_prefix(seq.token_ids, max_tokens=len(seq.token_ids) - 1,
                                              seed=seq.hash_seed).num_tokens
                self._cached_estimate[seq] = cached
            remaining -= cached
        waited_s = max(0, now_ns - seq.arrival_ns) / 1e9
        return remaining / (1.0 + waited_s / self.policy.aging_s) / priority_weight(seq.priority), seq.arrival_ns

    def _schedule_prefill(self) -> ScheduledBatch:
        batch = ScheduledBatch(True, [], [])
        budget = self.max_batched_tokens
        for seq in self.running:  # continue prompts already being chunked
            if budget == 0:
                break
            n = min(seq.num_uncomputed, budget)
            if seq.num_uncomputed > 1 and self._try_grow(seq, n):
                batch.seqs.append(seq), batch.num_tokens.append(n)
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            self._admit_prefix(seq)
            n = min(seq.num_uncomputed, budget)
            if not self._try_grow(seq, n):
                self._drop_blocks(seq)  # retry later, when blocks are free
                break
            self.waiting.popleft()
            seq.first_scheduled_ns = seq.first_scheduled_ns or time.time_ns()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq), batch.num_tokens.append(n)
            budget -= n
        return batch

    def _schedule_decode(self) -> ScheduledBatch | None:
        batch = ScheduledBatch(False, [], [])
        for seq in list(self.running):
            if seq.status is not SeqStatus.RUNNING or seq.num_uncomputed != 1:
                continue
            while not self._try_grow(seq, 1):
                victim = self.victim()
                self.preempt(victim)
                if victim in batch.seqs:  # taken earlier in this step (a lower priority, older): not any more
                    i = batch.seqs.index(victim)
                    del batch.seqs[i], batch.num_tokens[i]
                if victim is seq:
                    break
            if seq.status is SeqStatus.RUNNING:
                batch.seqs.append(seq), batch.num_tokens.append(1)
        if not batch.seqs and len(self.running) > 1:
            self.preempt(self.victim())  # prompts stuck mid-prefill: free room for the others
        return batch if batch.seqs else None

    def _admit_prefix(self, seq: Sequence) -> None:
        try:
            self._match_prefix(seq)
        finally:
            self._unpin(seq)

    def _unpin(self, seq: Sequence) -> None:
        if seq.pinned_blocks:
            self.bm.release(reversed(seq.pinned_blocks))
            seq.pinned_blocks = []

    def _match_prefix(self, seq: Sequence) -> None:
        if seq.block_table or not self.enable_prefix_cache:
            return
        # Leave at least one token to compute: its logits choose the next token.
        match = self.bm.match_prefix(seq.token_ids, max_tokens=len(seq.token_ids) - 1, seed=seq.hash_seed)
        if match.block_ids:
            self.bm.acquire(match.block_ids)
            seq.block_table = list(match.block_ids)
            seq.num_computed = match.num_tokens
            seq.num_registered_blocks = len(match.block_ids)
            if seq.num_preemptions == 0:
                seq.num_device_cached = match.num_tokens
                self.stats.device_cached_tokens += match.num_tokens

    def _try_grow(self, seq: Sequence, n: int) -> bool:
        """Make room for n more computed tokens; False (nothing changed) if blocks ran out."""
        need = -(-(seq.num_computed + n) // self.block_size) - len(seq.block_table)
        if need <= 0:
            return True
        try:
            seq.block_table.extend(self.bm.allocate(need))
        except OutOfBlocks:
            return False
        return True

    def _drop_blocks(self, seq: Sequence) -> None:
        self.bm.release(reversed(seq.block_table))  # tails evict before their prefixes
        seq.block_table, seq.num_computed, seq.num_registered_blocks = [], 0, 0

    def victim(self) -> Sequence:
        """Who loses its blocks when KV runs out: the lowest priority, and among those the newest."""
        return min(reversed(self.running), key=lambda s: s.priority)

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._drop_blocks(seq)
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Release the sequence's ownership of its blocks (they stay cached if registered), unless a
        caller takes them over: `retain_kv`, or a prefill-only sequence finishing "prefilled" (its KV
        is about to be handed off). An aborted sequence always releases."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._cached_estimate.pop(seq, None)
        self._unpin(seq)
        keep = reason != "abort" and (seq.retain_kv or (seq.prefill_only and reason == "prefilled"))
        if seq.block_table and not keep:
            self._drop_blocks(seq)
        seq.status, seq.finish_reason = SeqStatus.FINISHED, reason

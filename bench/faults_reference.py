"""Wrong tokens: every answer the system gave (whole, or the part a stream got before it was cut) against
the greedy answer of the same model run in-process by shared.engine, token by token."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Check:
    compared: int       # answers compared
    wrong_answers: int  # answers that differ from the reference (a cut stream: not a prefix of it)
    wrong_tokens: int   # reference tokens from the first difference to the end of what was received
    examples: tuple[str, ...] = ()


class Reference:
    """Greedy references, computed in batches and remembered per (prompt, max_tokens)."""

    def __init__(self, model_name: str = "tiny", num_blocks: int = 2048):
        from shared.engine.engine import Engine, EngineConfig
        from shared.engine.models import load_model

        self.model = load_model(model_name)
        self.engine = Engine(self.model, EngineConfig(num_blocks=num_blocks, enable_prefix_cache=False))
        self.cache: dict[tuple[str, int], tuple[list[int], str]] = {}  # -> (token ids, text)

    def _fill(self, keys: list[tuple[str, int]], batch: int = 16) -> None:
        from shared.engine.sampling import SamplingParams

        todo = [k for k in dict.fromkeys(keys) if k not in self.cache]
        for i in range(0, len(todo), batch):
            part = todo[i:i + batch]
            seqs = self.engine.generate([self.model.tokenizer.encode(p) for p, _ in part],
                                        [SamplingParams(max_tokens=n, ignore_eos=True) for _, n in part])
            for key, seq in zip(part, seqs):
                self.cache[key] = (list(seq.output_ids), seq.output_text)

    def wrong_tokens(self, received: str, complete: bool, ids: list[int], full: str) -> int:
        """0 when `received` is the reference text (or, cut short, a prefix of it); else the number of
        reference tokens from the first one whose text `received` does not continue with."""
        decode = self.model.tokenizer.decode
        if received == full or (not complete and full.startswith(received)):
            return 0
        matched = 0
        for n in range(1, len(ids) + 1):  # the longest token prefix whose text `received` starts with
            if not received.startswith(decode(ids[:n])):
                break
            matched = n
        if not complete:  # only what was received counts: tokens past its end were never sent
            got = len(self.model.tokenizer.encode(received))
            return max(1, min(len(ids), got) - matched)
        return len(ids) - matched

    def _tokens_needed(self, max_tokens: int, text: str, complete: bool) -> int:
        """A cut stream is checked against as many reference tokens as it could have received: no token is
        shorter than a byte of its text (greedy: the first n tokens do not depend on max_tokens)."""
        return max_tokens if complete else max(1, min(max_tokens, len(text.encode()) + 1))

    def check(self, answers: list[tuple[str, int, str, bool]]) -> Check:
        """answers: (prompt, max_tokens, text received, complete)."""
        import torch

        answers = [(p, self._tokens_needed(n, t, c), t, c) for p, n, t, c in answers]
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # measured on the shared 2-core box: 13x faster than 2 threads under load
        try:
            self._fill([(p, n) for p, n, _, _ in answers])
        finally:
            torch.set_num_threads(threads)
        wrong_answers = wrong_tokens = 0
        examples: list[str] = []
        for prompt, n, text, complete in answers:
            ids, want = self.cache[(prompt, n)]
            w = self.wrong_tokens(text, complete, ids, want)
            if w:
                wrong_answers += 1
                wrong_tokens += w
                if len(examples) < 3:
                    examples.append(f"prompt ...{prompt[-40:]!r}: got {text[:60]!r}, want {want[:60]!r}")
        return Check(len(answers), wrong_answers, wrong_tokens, tuple(examples))

"""When a sequence stops, and what text it has shown so far.

Stop reasons follow OpenAI: "stop" (EOS, a stop token id, or a stop string) or "length". A stop
string is cut from the text. Text that may still turn into a stop string, or that ends in a partial
UTF-8 character, is held back so a streamed delta never has to be taken back.
"""

from __future__ import annotations

from shared.engine.sequence import Sequence
from shared.engine.tokenizer import Tokenizer


def check_stop(seq: Sequence, tokenizer: Tokenizer, eos_token_ids: frozenset[int]) -> str | None:
    """Updates seq.output_text with what may be shown; returns the finish reason, if any."""
    p, token = seq.params, seq.token_ids[-1]
    reason = None
    shown_ids = seq.output_ids
    if (token in eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
        reason, shown_ids = "stop", shown_ids[:-1]  # the stopping token counts but is not shown
    text = tokenizer.decode(shown_ids, skip_special_tokens=True)
    if p.stop:
        # only the newly decoded tail (plus overlap) can hold a stop string that was not there before
        search_from = max(0, len(seq.output_text) - max(len(s) for s in p.stop))
        hits = [i for i in (text.find(s, search_from) for s in p.stop) if i >= 0]
        if hits:
            seq.output_text = text[:min(hits)]
            return "stop"
    if reason is None and len(seq.output_ids) >= p.max_tokens:
        reason = "length"
    if reason is not None:
        seq.output_text = text
        return reason
    hold = max((len(s) - 1 for s in p.stop), default=0)
    visible = text.rstrip("\ufffd")
    visible = visible[:max(len(seq.output_text), len(visible) - hold)]
    seq.output_text = visible
    return None

"""check_stop, driven the way the engine drives it: append one token, then check.

Invariants checked on every step: the shown text (seq.output_text) only ever grows by appending
(a streamed delta is never taken back) and never shows a replacement char for a partial UTF-8 tail.
"""

from __future__ import annotations

import random

import pytest

from shared.engine.sampling import SamplingParams
from shared.engine.sequence import Sequence
from shared.engine.stopping import check_stop
from shared.engine.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
EOS = frozenset(TOK.eos_token_ids)
IM_END = TOK.special_tokens["<|im_end|>"]
ENDOFTEXT = TOK.special_tokens["<|endoftext|>"]
PROMPT = TOK.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def feed(token_ids: list[int], params: SamplingParams, prompt: list[int] = PROMPT):
    """Appends tokens one at a time until a stop. Returns (seq, reason, shown texts, tokens used)."""
    seq = Sequence("r", list(prompt), params)
    shown: list[str] = []
    reason = None
    for n, t in enumerate(token_ids, 1):
        prev = seq.output_text
        seq.token_ids.append(t)
        reason = check_stop(seq, TOK, EOS)
        assert seq.output_text.startswith(prev), f"shown text taken back: {prev!r} -> {seq.output_text!r}"
        shown.append(seq.output_text)
        if reason is not None:
            return seq, reason, shown, n
    return seq, reason, shown, len(token_ids)


def b(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def test_eos_stops_with_stop():
    for eos in (IM_END, ENDOFTEXT):
        seq, reason, _, n = feed(b("hello") + [eos] + b("more"), SamplingParams(max_tokens=50))
        assert reason == "stop" and n == 6
        assert seq.output_text == "hello"  # the special token is not shown


def test_ignore_eos_keeps_going_until_length():
    seq, reason, _, n = feed(b("ab") + [IM_END] + b("cdef"), SamplingParams(max_tokens=5, ignore_eos=True))
    assert reason == "length" and n == 5
    assert seq.output_text == "abcd"  # the ignored EOS is a special token: not shown


def test_stop_token_ids():
    seq, reason, _, n = feed(b("abcxyz"), SamplingParams(max_tokens=50, stop_token_ids=(ord("x"),)))
    assert reason == "stop" and n == 4
    assert seq.output_text == "abc"  # the stop token ends the request but is not shown (as in vLLM)


def test_stop_token_id_works_even_with_ignore_eos():
    _, reason, _, n = feed(b("ab") + [IM_END, ord(",")], SamplingParams(
        max_tokens=50, ignore_eos=True, stop_token_ids=(IM_END,)))
    assert reason == "stop" and n == 3


def test_max_tokens_length():
    seq, reason, shown, n = feed(b("abcdefgh"), SamplingParams(max_tokens=3))
    assert reason == "length" and n == 3
    assert seq.output_text == "abc"
    assert shown == ["a", "ab", "abc"]  # no stop strings: nothing is held back


def test_no_stop_before_limit_returns_none():
    _, reason, shown, _ = feed(b("abc"), SamplingParams(max_tokens=10))
    assert reason is None and shown[-1] == "abc"


def test_stop_string_across_tokens_is_cut_and_never_retracted():
    text = "hello ENx EN END tail"
    seq, reason, shown, n = feed(b(text), SamplingParams(max_tokens=100, stop=("END",)))
    assert reason == "stop"
    assert n == text.index("END") + 3  # stopped on the token that completed it
    assert seq.output_text == "hello ENx EN "
    # partial matches ("EN") were held back, never shown then withdrawn (checked in feed), and the
    # stream did make progress before the stop
    assert "hello" in shown[n - 2]


def test_stop_string_at_start_gives_empty_text():
    seq, reason, shown, _ = feed(b("STOPabc"), SamplingParams(max_tokens=100, stop=("STOP",)))
    assert reason == "stop" and seq.output_text == "" and all(s == "" for s in shown)


def test_earliest_of_several_stop_strings_wins():
    # "abc" starts before "bc"; both complete on the same token
    seq, reason, _, _ = feed(b("xabcd"), SamplingParams(max_tokens=100, stop=("bc", "abc")))
    assert reason == "stop" and seq.output_text == "x"
    # the one that completes first stops generation even if the other is longer
    seq, reason, _, n = feed(b("xy12345"), SamplingParams(max_tokens=100, stop=("12345", "y1")))
    assert reason == "stop" and seq.output_text == "x" and n == 3


def test_stop_string_in_prompt_is_ignored():
    prompt = TOK.encode("say END please")
    seq, reason, _, _ = feed(b("ok then"), SamplingParams(max_tokens=7, stop=("END",)), prompt=prompt)
    assert reason == "length" and seq.output_text == "ok then"


def test_held_back_text_is_flushed_at_length():
    seq, reason, shown, _ = feed(b("abcde"), SamplingParams(max_tokens=5, stop=("STOP",)))
    assert reason == "length"
    assert shown[:-1] == ["", "", "", "a"]  # 3 chars held back while "STOP" could still form
    assert seq.output_text == "abcde"


def test_held_back_text_is_flushed_at_eos():
    seq, reason, shown, _ = feed(b("abST") + [IM_END], SamplingParams(max_tokens=50, stop=("STOP",)))
    assert reason == "stop"
    assert shown[-2] == "a"
    assert seq.output_text == "abST"


def test_partial_utf8_never_shown_mid_stream():
    text = "héllo € 😀 日本語!"
    seq, reason, shown, _ = feed(b(text) + [IM_END], SamplingParams(max_tokens=100))
    assert reason == "stop" and seq.output_text == text
    assert all("\ufffd" not in s for s in shown)
    # every shown state is a prefix of the final text (on a whole-character boundary)
    assert all(text.startswith(s) for s in shown)


def test_partial_utf8_with_stop_string_made_of_multibyte_chars():
    text = "ab€€c😀😀d"
    seq, reason, shown, _ = feed(b(text), SamplingParams(max_tokens=100, stop=("😀😀",)))
    assert reason == "stop" and seq.output_text == "ab€€c"
    assert all("\ufffd" not in s for s in shown)


def test_partial_utf8_tail_flushed_at_length():
    data = "a€".encode("utf-8")[:-1]  # "a" + 2 of the 3 bytes of "€"
    seq, reason, shown, _ = feed(list(data), SamplingParams(max_tokens=len(data)))
    assert reason == "length"
    assert shown[:-1] == ["a", "a"]
    assert seq.output_text.startswith("a")  # what the bytes decode to, replacement char included


def _reference(text_steps: list[str], stops: tuple[str, ...], max_tokens: int, eos_at: int | None):
    """Final (reason, text) computed naively from the decoded text after each step."""
    for i, text in enumerate(text_steps, 1):
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return "stop", text[:min(hits)]
        if eos_at is not None and i == eos_at:
            return "stop", text
        if i >= max_tokens:
            return "length", text
    return None, None


@pytest.mark.parametrize("seed", range(30))
def test_random_streams_against_reference(seed):
    rng = random.Random(seed)
    alphabet = ["a", "b", "c", "é", "€", "😀"]
    stops = tuple({"".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4)))
                   for _ in range(rng.randint(1, 3))})
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
    ids = b(text)
    eos_at = None
    if rng.random() < 0.3:
        eos_at = rng.randint(1, len(ids))
        ids = ids[:eos_at - 1] + [IM_END] + ids[eos_at - 1:]
    max_tokens = rng.randint(1, len(ids) + 2)
    seq, reason, shown, n = feed(ids, SamplingParams(max_tokens=max_tokens, stop=stops))
    steps = [TOK.decode(ids[:i]) for i in range(1, len(ids) + 1)]
    want_reason, want_text = _reference(steps, stops, max_tokens, eos_at)
    if want_reason is None:  # ran out of tokens first
        assert reason is None
        assert text.startswith(seq.output_text)
        return
    assert (reason, seq.output_text) == (want_reason, want_text), (stops, text, max_tokens, eos_at)
    assert all("\ufffd" not in s for s in shown[:-1])

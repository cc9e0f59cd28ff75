"""The incremental detokenizer, token by token, over text whose characters span
several byte-level BPE tokens (emoji, CJK, accents).

The oracle is the tokenizer's own `decode` of the ids so far, never the
detokenizer: after every token the text is that decode when it ends with a
complete character, and a prefix of it while a character is incomplete; no
prefix ever shows U+FFFD.
"""

from __future__ import annotations

import pytest
from conftest import require_smollm2
from server_harness import make_tokenizer

from infer.core.detokenizer import IncrementalDetokenizer, find_stop

TEXTS = [
    "Héllo 🙂 日本語 naïve café 👍🏽 — ok",
    "日本語のテキストと한국어",
    "👩‍👩‍👧 family, ½ price, Ünïcödé",
    "€100 → ∞ ✓",
]
PROMPT = "Say something:"


@pytest.fixture(scope="module", params=["smollm2", "tiny-bpe"])
def tokenizer(request):
    if request.param == "tiny-bpe":  # trained on a short corpus: most non-ASCII characters stay split in bytes
        return make_tokenizer()
    require_smollm2()
    from infer.core.loader import load_model

    return load_model("smollm2", load_weights=False).tokenizer


@pytest.mark.parametrize("text", TEXTS)
def test_text_after_each_token_is_the_tokenizers_decode_of_the_ids_so_far(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert tokenizer.decode(ids) == text  # the oracle round-trips
    detok = IncrementalDetokenizer(tokenizer, tokenizer(PROMPT, add_special_tokens=False).input_ids)
    deltas = []
    for k, token in enumerate(ids, 1):
        deltas.append(detok.add(token))
        assert "\ufffd" not in detok.text, f"U+FFFD after {k} tokens: {detok.text!r}"
        decoded = tokenizer.decode(ids[:k])
        if decoded.endswith("\ufffd"):  # the last token ends mid-character: its text waits for the rest
            assert decoded.startswith(detok.text), f"after {k} tokens"
        else:
            assert detok.text == decoded, f"after {k} tokens"
    assert detok.text == "".join(deltas) == text


def test_the_texts_really_split_characters_across_tokens(tokenizer):
    """Guards the test above: some token of each text decodes to a partial character."""
    for text in TEXTS:
        ids = tokenizer(text, add_special_tokens=False).input_ids
        assert any("\ufffd" in tokenizer.decode([t]) for t in ids), text


def test_a_character_is_emitted_whole_by_the_token_that_completes_it(tokenizer):
    ids = tokenizer("🙂日", add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(tokenizer, [])
    deltas = [detok.add(t) for t in ids]
    assert [d for d in deltas if d] in (["🙂", "日"], ["🙂日"])
    assert all(d == "" or "\ufffd" not in d for d in deltas)


def test_stop_string_of_multibyte_characters_is_found_when_its_last_byte_arrives(tokenizer):
    text = "Héllo 🙂 日本語 naïve"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(tokenizer, [])
    for k, token in enumerate(ids, 1):
        delta = detok.add(token)
        hit = find_stop(detok.text, len(delta), ("本語",)) if delta else None
        if hit is not None:
            break
    assert hit == (text.index("本語"), "本語")
    assert tokenizer.decode(ids[:k]).endswith("本語")  # found by the token that completed it, not later


def test_each_token_decodes_a_short_window_not_the_whole_text(tokenizer):
    """Incremental: the cost per token does not grow with the text (a window that
    never slides would decode everything so far, every token)."""
    lengths = []

    class Spy:
        def decode(self, ids, **kw):
            lengths.append(len(ids))
            return tokenizer.decode(ids, **kw)

    ids = tokenizer(" ".join(TEXTS) * 3, add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(Spy(), tokenizer(PROMPT, add_special_tokens=False).input_ids)
    for token in ids:
        detok.add(token)
    assert len(ids) > 100 and max(lengths) <= 16


def test_stop_strings_starting_at_the_same_place_report_the_first_listed():
    assert find_stop("x本語本", 4, ("本語", "本語本")) == (1, "本語")
    assert find_stop("x本語本", 4, ("本語本", "本語")) == (1, "本語本")


def test_a_stop_string_at_the_very_start_of_the_text_is_found():
    assert find_stop("本語です", 4, ("本語",)) == (0, "本語")
    assert find_stop("ab", 2, ("ab", "b")) == (0, "ab")
    assert find_stop("ab", 1, ("ab", "b")) == (0, "ab")  # the token that completes it added only "b"


def test_a_stop_string_that_ended_before_the_new_characters_is_not_reported_again():
    """find_stop looks for stop strings that end within the last `new_chars` characters only."""
    assert find_stop("ab_xyz", 3, ("ab",)) is None
    assert find_stop("ab_xyz", 3, ("ab", "yz")) == (4, "yz")
    assert find_stop("ab_xyz", 4, ("ab",)) is None  # "ab" ends at the 2nd character, before the last 4
    assert find_stop("ab_xyz", 4, ("b_",)) == (1, "b_")  # "b_" ends at the 3rd: within them

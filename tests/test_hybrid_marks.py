"""Snapshots at message starts (issue 47, item 1): a hybrid slot snapshots its recurrent state before every
message-start token a prefill feeds (the chat template's, message_marks.py), so an edit of an earlier message
resumes at that message's start instead of at the grid point before it.

Oracle: our own cold run (`--no-prefix-kv`, one full pass), bit for bit; what is reused is predicted exactly
(the edited message's start: the grid is set wider than the conversation so nothing else lies near it).
"""
from __future__ import annotations

import pytest
import torch

from ternlm.kv.recurrent import RecurrentShape, RecurrentState
from ternlm.text.message_marks import message_marks
from ternlm.text.tokenizer import Tokenizer
from hybrid_checks import folder_engine
from test_hybrid import hf_qwen35
from test_loaders import TEMPLATE as NO_MARK_TEMPLATE

CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }} {{ m.content }}<|im_end|> {% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")
SPECIAL = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]


def _save_chatml_tokenizer(folder) -> None:
    """A word-level tokenizer (w0..w199, the roles) with ChatML's two special tokens and a ChatML-like template."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {t: i for i, t in enumerate(SPECIAL + ["user", "assistant", "system"])}
    vocab.update({f"w{i}": len(vocab) + i for i in range(200)})
    raw = RawTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                  additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    tok.chat_template = CHATML
    tok.save_pretrained(folder)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen35-marks")
    hf_qwen35(seed=5).save_pretrained(path)
    _save_chatml_tokenizer(path)
    return path


def _chat(n: int, edited: int | None = None) -> list[dict]:
    """n messages (system, then user/assistant alternating), 7-30 words each; `edited`: that message's content
    gets a word in front (an edit that diverges right after its role)."""
    roles = ["system"] + ["user", "assistant"] * n
    msgs = [{"role": roles[i], "content": " ".join(f"w{(i * 37 + j * 11) % 200}" for j in range(7 + (i * 13) % 24))}
            for i in range(n)]
    if edited is not None:
        msgs[edited]["content"] = "w199 " + msgs[edited]["content"]
    return msgs


def _starts(ids: list[int], mark: int) -> list[int]:
    return [p for p, t in enumerate(ids) if t == mark]


def test_the_template_s_message_start_token_is_found(folder):
    tok = Tokenizer.from_hf_folder(folder)
    mark = tok.token_to_id("<|im_start|>")
    assert message_marks(CHATML, tok) == {mark}
    assert message_marks(None, tok) == frozenset()
    assert message_marks(NO_MARK_TEMPLATE, tok) == frozenset()             # messages open with plain text
    only_users = "{% for m in messages %}{% if m.role == 'user' %}<|im_start|>{% endif %}{{ m.content }} {% endfor %}"
    assert message_marks(only_users, tok) == frozenset()                   # the assistant's start is no mark
    dense = folder_engine(folder)
    assert dense.message_marks == {mark} and dense.slots[0].state.marks == {mark}


def test_wants_marks_beside_the_grid_and_the_prefill_end():
    """The bookkeeping alone: the state before each mark fed, the one at the feed's start only when the live state
    is there, at most half the budget's newest marks; grid and prefill end as before."""
    st = RecurrentState(RecurrentShape(1, 4, 3, 2, 2, 2), interval=64, max_snapshots=6, marks=frozenset({9}))
    ids = [1] * 200
    for p in (5, 70, 150):
        ids[p] = 9
    assert st.wants(0, ids, prefill_end=True) == [5, 64, 70, 128, 150, 192, 200]
    assert st.wants(0, ids, prefill_end=False) == [5, 64, 70, 128, 150, 192]
    assert st.wants(0, [1] * 200, prefill_end=True) == [64, 128, 192, 200]             # no mark: as before
    st.pos = 10
    assert st.wants(10, [9, 1, 9], prefill_end=True) == [10, 12, 13]
    assert st.wants(11, [9, 1, 9], prefill_end=True) == [13, 14]                    # not at pos: no copy at 11
    many = [9, 1] * 10
    assert st.wants(10, many, prefill_end=False) == [24, 26, 28]                    # newest 6 // 2 marks


def test_prefill_snapshots_every_message_start_and_an_edit_resumes_there(folder):
    """A 9-message chat prefilled in chunks (one chunk starting on a message start: the live-state copy) holds a
    snapshot before every message-start token; editing message i of it reuses exactly up to message i's start,
    with the cold run's bits; the re-prefill snapshots the starts it feeds again."""
    warm, cold = folder_engine(folder, state_interval=4096), folder_engine(folder, prefix_reuse=False)
    mark = warm.tokenizer.token_to_id("<|im_start|>")
    base = warm.apply_chat_template(_chat(9))
    starts = _starts(base, mark)
    assert len(starts) == 10                                               # 9 messages + the generation prompt
    warm.runner.chunk_size = starts[3]                                     # chunk 2 starts on message 3's start
    for i in (6, 2, 7, 1):
        warm.generate(base, max_tokens=1, ignore_eos=True, slot=0)
        assert set(starts) <= set(warm.slots[0].state.snaps), i
        prompt = warm.apply_chat_template(_chat(9, edited=i))
        got = warm.generate(prompt, max_tokens=3, ignore_eos=True, keep_logits=True, slot=0)
        assert got.cached_tokens == starts[i], i                           # [RESUME-AT-SNAPSHOT] at message i
        assert torch.equal(got.logits, cold.logits(prompt + got.token_ids[:-1])[len(prompt) - 1:]), i
        assert set(_starts(prompt, mark)) <= set(warm.slots[0].state.snaps), i


def test_a_tight_budget_keeps_the_newest_message_starts(folder):
    """With 8 snapshots allowed, a long chat's prefill keeps the newest 4 message starts (the boundary pool's half)
    and its end; an edit of the 3rd-from-last message still resumes at its start."""
    warm, cold = folder_engine(folder, state_interval=4096), folder_engine(folder, prefix_reuse=False)
    mark = warm.tokenizer.token_to_id("<|im_start|>")
    warm.slots[0].state.max_snapshots = 8
    base = warm.apply_chat_template(_chat(12))
    starts = _starts(base, mark)
    warm.generate(base, max_tokens=1, ignore_eos=True, slot=0)
    assert set(starts[-4:]) <= set(warm.slots[0].state.snaps) and len(warm.slots[0].state.snaps) <= 8
    prompt = warm.apply_chat_template(_chat(12, edited=9))
    got = warm.generate(prompt, max_tokens=2, ignore_eos=True, keep_logits=True, slot=0)
    assert got.cached_tokens == starts[9]
    assert torch.equal(got.logits, cold.logits(prompt + got.token_ids[:-1])[len(prompt) - 1:])



def test_a_tier_reaching_less_far_than_the_slot_does_not_replace_it(folder):
    """Issue 47's edit replay, turn 25 of 30 (--tiers): the edit diverged 6 tokens after its message's start, a
    block edge fell between the two, so the tiers offered more than the slot's resume point (the message-start
    snapshot) -- but the slot held no snapshot at that block's start, and the tiers' states reached only an early
    block: the placement dropped the slot's prefix for the tiers' shorter one (192 of 9,282 tokens reused). Here in
    small: marks at 64 (a block edge: the tier's block [0, 64) carries the state there, the slot has since dropped
    it) and 124, the prompt diverging at 130, past the edge 128; no grid. The slot's snapshot at 124 must be what
    resumes, with the cold run's bits."""
    from ternlm.kv.store import CacheConfig
    warm = folder_engine(folder, state_interval=4096, cache=CacheConfig(ram_bytes=64 << 20))
    cold = folder_engine(folder, prefix_reuse=False)
    try:
        mark = warm.tokenizer.token_to_id("<|im_start|>")
        words = [warm.tokenizer.token_to_id(f"w{i % 200}") for i in range(400)]
        base = words[:300]
        for p in (64, 124, 210, 230):
            base[p] = mark
        warm.slots[0].state.max_snapshots = 4         # over it, the oldest message start (64) goes first
        warm.generate(base[:200], max_tokens=1, ignore_eos=True, slot=0)
        base[199] = words[250]                        # resumes at 124; [0, 200) goes to the tier, state at 64
        warm.generate(base, max_tokens=1, ignore_eos=True, slot=0)
        warm.store.flush(10)
        snaps = set(warm.slots[0].state.snaps)
        assert 124 in snaps and 64 not in snaps
        assert any(e.state is not None and len(e.meta.ids) == 64 for e in warm.store.ram.oldest_first())
        prompt = base[:130] + words[300:340]
        got = warm.generate(prompt, max_tokens=3, ignore_eos=True, keep_logits=True, slot=0)
        assert got.cached_tokens == 124, got.reuse.why
        assert torch.equal(got.logits, cold.logits(prompt + got.token_ids[:-1])[len(prompt) - 1:])
    finally:
        warm.store.close(10)

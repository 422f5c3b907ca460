"""`api.stream`: the decoding loops in chunks give the tokens of the whole loop (and so, greedy,
the autoregressive tokens), chunk by chunk as they are committed; the text deltas of
tokenizers that cut characters between tokens (a byte-per-token one and Qwen3's)."""

import math

import numpy as np
import pytest

from helpers import random_prompts, tiny_head, tiny_target
from jetspec_jax import api
from jetspec_jax.decode.streaming import TextDeltas
from jetspec_jax.io.load import Draft, Target
from jetspec_jax.io.tokenizer import Tokenizer


def models(kind, seed):
    tcfg, tparams = tiny_target(kind, seed=seed, vocab=24)
    dcfg, dparams = tiny_head(tcfg, seed=seed + 1, block_size=5)
    return Target(tcfg, tparams, None, tcfg.name), Draft(dcfg, dparams)


def joined(chunks, b):
    return sum((c.tokens[b] for c in chunks), [])


@pytest.mark.parametrize("kind, seed, budget, tree, chunk", [
    ("dense", 0, 8, "accum_logp", 1), ("moe", 1, 16, "top2gap", 3), ("llama", 2, 4, "chain", 2)])
def test_stream_gives_the_whole_loops_tokens_chunk_by_chunk(kind, seed, budget, tree, chunk):
    target, draft = models(kind, seed)
    prompt, lens = random_prompts(np.random.default_rng(seed), 3, 7, target.cfg.vocab_size)
    prompts = [p[:n].tolist() for p, n in zip(np.asarray(prompt), np.asarray(lens))]
    kw = dict(max_new_tokens=12, stop_ids=(seed + 3,))
    ar = api.generate(target, prompts, **kw)
    spec = api.generate(target, prompts, draft=draft, budget=budget, tree=tree, **kw)
    assert spec.tokens == ar.tokens  # greedy, float32

    chunks = list(api.stream(target, prompts, draft=draft, budget=budget, tree=tree,
                             chunk=chunk, **kw))
    # One chunk after the prefill, then one per `chunk` rounds of the longest sequence.
    assert len(chunks) == 1 + math.ceil(max(spec.rounds) / chunk)
    assert [joined(chunks, b) for b in range(3)] == spec.tokens
    assert chunks[-1].rounds == spec.rounds and all(chunks[-1].done)
    assert not all(chunks[-2].done) and chunks[0].rounds == [0, 0, 0]
    assert [len(t) for t in chunks[0].tokens] == [1, 1, 1]  # the prefill's token
    for before, after in zip(chunks, chunks[1:]):
        assert all(after.num_tokens[b] == before.num_tokens[b] + len(after.tokens[b])
                   for b in range(3))
        assert all(not t for t, d in zip(after.tokens, before.done) if d)  # done stays done

    plain = list(api.stream(target, prompts, chunk=chunk, **kw))
    assert [joined(plain, b) for b in range(3)] == ar.tokens and plain[-1].rounds is None
    assert len(plain) == 1 + math.ceil((max(map(len, ar.tokens)) - 1) / chunk)


def test_stream_sampling_follows_the_same_random_stream_as_generate():
    target, draft = models("dense", 5)
    kw = dict(max_new_tokens=10, stop_ids=(), temperature=1.0, top_k=12, seed=7)
    for head in (draft, None):
        whole = api.generate(target, [[1, 2, 3], [4]], draft=head, budget=8, **kw)
        chunks = list(api.stream(target, [[1, 2, 3], [4]], draft=head, budget=8, **kw))
        assert [joined(chunks, b) for b in range(2)] == whole.tokens


def test_stream_checks_its_options_before_returning():
    target, draft = models("dense", 0)
    with pytest.raises(ValueError, match="chunk must be a whole number of steps >= 1, got 0"):
        api.stream(target, [[1, 2]], draft=draft, chunk=0)
    with pytest.raises(ValueError, match="budget must be a number of tree nodes"):
        api.stream(target, [[1, 2]], draft=draft, budget="many")
    with pytest.raises(TypeError, match="compare_autoregressive"):
        api.stream(target, [[1, 2]], draft=draft, compare_autoregressive=True)


class ByteTokenizer:
    """One token per UTF-8 byte: a multi-byte character is cut between tokens."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def test_text_deltas_hold_back_a_character_until_its_bytes_are_all_there():
    text = "naïve café → 東京!"
    ids = list(text.encode())
    deltas = TextDeltas(ByteTokenizer(), batch=1)
    out = [deltas(0, ids[:n], final=n == len(ids)) for n in range(1, len(ids) + 1)]
    assert "".join(out) == text and not any("\ufffd" in d for d in out)
    assert out[ids.index(0xE6)] == ""  # the first byte of 東 alone: nothing yet
    cut = TextDeltas(ByteTokenizer(), batch=1)  # a sequence ending mid-character
    assert cut(0, ids[:3], final=False) == "na" and cut(0, ids[:3], final=True) == "\ufffd"
    assert TextDeltas(None, batch=2)(1, ids, final=True) == ""


def test_text_deltas_with_the_real_qwen3_tokenizer():
    """Byte-level BPE splits rare characters over tokens: one token at a time, the deltas
    still join to the text, with nothing half-decoded in between."""
    tok = Tokenizer.qwen3()
    text = "Ответ: 東京 𝔘𝔫𝔦 🎉 naïve ∮ dx"
    ids = tok.encode(text, add_special_tokens=False)
    deltas = TextDeltas(tok, batch=1)
    out = [deltas(0, ids[:n], final=n == len(ids)) for n in range(1, len(ids) + 1)]
    assert "".join(out) == text and not any("\ufffd" in d for d in out)
    assert "" in out[:-1]  # some character waited for its next token

"""Draft-head training: the training forward equals inference, the loss falls, runs resume
exactly, and the self-distillation data builder writes and resumes shards (its prompts and
sampled answers: test_train_data.py)."""

import dataclasses
import functools
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import tiny_head, tiny_target
from jetspec_jax.decode.autoregressive import prefill
from jetspec_jax.decode.sampling import Sampler
from jetspec_jax.draft import head as draft_head
from jetspec_jax.draft.head import draft_specs
from jetspec_jax.model import target
from jetspec_jax.model.params import init_params
from jetspec_jax.train import data as D
from jetspec_jax.train.head_forward import head_logits, sample_anchors, target_pass
from jetspec_jax.train.loss import distill_loss
from jetspec_jax.train.head_kinds import HEADS
from jetspec_jax.train.trainer import TrainConfig, read_metrics, train


class CharTokenizer:
    """Duck-typed tokenizer: a 'chat template' of [BOS, chars...]."""

    eos_token_ids = ()
    pad_id = 0

    def apply_chat_template(self, messages):
        return [1] + [2 + ord(c) % 10 for c in messages[0]["content"]]


TIMING = ("time", "step_s", "tok_s", "mfu")  # wall-clock fields of a metrics row
DATA_KW = dict(shard_size=4, max_prompt_len=16, max_new=12, batch_size=4, sampler=Sampler(),
               seed=0, progress=False)
PROMPTS = [f"prompt {i} " + "ab" * (i % 4) for i in range(10)]


@pytest.fixture(scope="module")
def tiny():
    return tiny_target("dense", seed=2, vocab=16)


@pytest.fixture(scope="module")
def dataset(tiny, tmp_path_factory):
    tcfg, tp = tiny
    root = tmp_path_factory.mktemp("data")
    D.make_dataset(tp, tcfg, CharTokenizer(), PROMPTS[:8], root / "train", **DATA_KW)
    D.make_dataset(tp, tcfg, CharTokenizer(), PROMPTS[8:], root / "heldout", **DATA_KW)
    return root


@pytest.mark.parametrize("kind,causal,mask_id", [
    ("dense", True, None), ("dense", True, 3), ("dense", False, None), ("dense", False, 3),
    ("llama", True, None)])
def test_training_forward_equals_inference(kind, causal, mask_id):
    """Block at anchor a in one training pass == extend_context(taps of 0..a-1, from prefill,
    as at decode time) then draft_block(anchor=token[a]), in float32."""
    tcfg, tp = tiny_target(kind, seed=2, vocab=16)
    dcfg, dp = tiny_head(tcfg, causal=causal, mask_token_id=mask_id)
    tokens = jax.random.randint(jax.random.key(5), (2, 20), 0, tcfg.vocab_size)
    anchors = jnp.array([[3, 11, 1], [7, 14, 19]], jnp.int32)
    t = tokens.shape[1]

    @jax.jit
    def training(tokens, anchors):
        _, taps = target_pass(tp, tcfg, tokens, dcfg.tap_layers)
        return head_logits(dp, dcfg, tp, tcfg, taps, tokens, anchors)  # [B, A, blk-1, V]

    @jax.jit
    def decoding(tokens, a):  # the decode-time route, batched over sequences
        visible = jnp.arange(t) < a[:, None]
        prefix = jnp.where(visible, tokens, 0)  # right-padded prompts of length a
        tcache = target.allocate_cache(tcfg, 2, 32, jnp.float32)
        _, _, ptaps = prefill(tp, tcfg, prefix, a, tcache, taps=dcfg.tap_layers)
        dcache = draft_head.extend_context(
            dp, dcfg, draft_head.allocate_cache(dcfg, 2, 32, jnp.float32),
            jnp.where(visible[..., None], ptaps, 0.0), a)  # taps of positions 0..a-1 only
        return draft_head.draft_block(dp, dcfg, tp, tcfg, dcache, tokens[jnp.arange(2), a])

    got = training(tokens, anchors)
    for j in range(anchors.shape[1]):
        np.testing.assert_allclose(got[:, j], decoding(tokens, anchors[:, j]), atol=1e-5,
                                   rtol=1e-5)


def test_target_pass_through_the_gpu_kernels_gives_the_same_taps():
    """The step's frozen target pass takes its attention from `kernels` (the GPU kernels on a
    GPU: `TrainConfig.target_attention`); the Pallas kernel alone, in interpret mode here, gives
    the reference's hidden states and taps."""
    from jetspec_jax.model.kernels import Kernels

    tcfg, tp = tiny_target("dense", seed=4, vocab=16)
    dcfg, _ = tiny_head(tcfg)
    tokens = jax.random.randint(jax.random.key(2), (2, 24), 0, tcfg.vocab_size)
    want = target_pass(tp, tcfg, tokens, dcfg.tap_layers)
    got = target_pass(tp, tcfg, tokens, dcfg.tap_layers,
                      Kernels(("portable",), interpret=True))  # no fallback
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="unknown attention kernel 'flash'"):
        TrainConfig(data_dir="-", out_dir="-", target_attention="flash")


def test_fused_attention_sees_what_the_dense_mask_shows():
    """`TrainConfig.head_attention` "cudnn" hands q, k, v and the blocks' visibility to one
    fused attention call; through XLA here, its output and gradients equal the dense float32
    attention's to bfloat16 precision (grouped KV heads, causal blocks after the context)."""
    from jetspec_jax.train.head_forward import block_visibility, fused_attention

    dcfg = dataclasses.replace(tiny_head(tiny_target("dense", seed=2, vocab=16)[0])[0],
                               block_size=4)
    anchors = jnp.array([[3, 11], [7, 1]], jnp.int32)
    visible = block_visibility(dcfg, anchors, 16)  # [2, 8, 16 + 8]
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (2, 8, 4, 16))
    k, v = (jax.random.normal(key, (2, 24, 2, 16)) for key in (kk, kv))

    def loss(fn, q, k, v):
        return jnp.sum(jnp.sin(fn(q, k, v, visible)))

    dense = draft_head.dense_attention
    fused = functools.partial(fused_attention, implementation="xla")
    np.testing.assert_allclose(fused(q, k, v, visible), dense(q, k, v, visible), atol=3e-2)
    for g, w in zip(jax.grad(functools.partial(loss, fused), (0, 1, 2))(q, k, v),
                    jax.grad(functools.partial(loss, dense), (0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(g, w, atol=5e-2)


def test_head_attention_auto_takes_cudnn_on_a_gpu_only(tiny, dataset, monkeypatch):
    """TrainConfig.head_attention "auto" (the default) resolves to cuDNN's fused attention on
    one GPU and to XLA's elsewhere (a data mesh too): here the step's loss equals the one with
    "reference"; "cudnn" without a GPU and unknown names are refused by name."""
    from jetspec_jax.train import trainer
    from jetspec_jax.train.trainer import head_attention, make_optimizer, make_steps

    tcfg, tp = tiny
    batch = {k: jnp.asarray(v[:4]) for k, v in D.load_shards(dataset / "train").items()}
    losses = {}
    for choice in ("auto", "reference"):
        cfg = train_config(dataset, ".", head_attention=choice)
        dcfg = cfg.draft_config(tcfg)
        tx = make_optimizer(cfg)[0]
        dp = init_params(draft_specs(dcfg), jax.random.key(0))
        losses[choice] = float(make_steps(cfg, tcfg, dcfg, tx)[1](
            dp, tp, batch, jax.random.key(1))["loss"])
    assert losses["auto"] == losses["reference"]
    auto = train_config(dataset, ".")
    assert auto.head_attention == "auto" and head_attention(auto) == "reference"
    monkeypatch.setattr(trainer.jax, "default_backend", lambda: "gpu")
    assert head_attention(auto) == "cudnn"
    assert head_attention(train_config(dataset, ".", head_attention="reference")) == "reference"
    assert head_attention(train_config(dataset, ".", mesh="data=1")) == "reference"
    monkeypatch.undo()
    with pytest.raises(ValueError, match="head_attention 'cudnn' needs a GPU"):
        make_steps(train_config(dataset, ".", head_attention="cudnn"), tcfg, dcfg, tx)
    with pytest.raises(ValueError, match="head_attention must be one of"):
        train_config(dataset, ".", head_attention="flash")


def test_distill_loss_masks_and_weights():
    teacher = jax.random.normal(jax.random.key(0), (2, 3, 4, 8))
    loss, m = distill_loss(teacher, teacher, jnp.ones((2, 3, 4), bool))
    assert abs(float(loss)) < 1e-6 and np.allclose(m["acc"], 1.0)
    head = teacher.at[:, :, 2].set(0.0)  # only depth 3 is wrong ...
    valid = jnp.ones((2, 3, 4), bool).at[:, :, 2].set(False)  # ... and masked out
    loss, m = distill_loss(head, teacher, valid, gamma=2.0)
    assert abs(float(loss)) < 1e-6 and np.asarray(m["count"]).tolist() == [6, 6, 0, 6]


def test_anchors_stay_in_the_response_region():
    lengths, prompt_lengths = jnp.array([20, 12, 9]), jnp.array([5, 9, 8])
    anchors, valid = sample_anchors(jax.random.key(0), lengths, prompt_lengths, 4, 24)
    for a, ok, n, p in zip(*map(np.asarray, (anchors, valid, lengths, prompt_lengths))):
        assert ((a >= p) & (a <= n - 2))[ok].all() and len(set(a[ok])) == ok.sum()
        assert ok.sum() == min(4, max(n - 1 - p, 0))  # all of a short region, no more


def test_make_dataset_writes_and_resumes(tiny, dataset, tmp_path, monkeypatch):
    tcfg, tp = tiny
    manifest = json.loads((dataset / "train" / "manifest.json").read_text())
    assert [s["num_seqs"] for s in manifest["shards"]] == [4, 4] and manifest["num_seqs"] == 8
    data = D.load_shards(dataset / "train")
    assert data["tokens"].shape == (8, 16 + 12) and data["tokens"].dtype == np.int32
    # No stop id: every response runs to max_new; the prompt is the chat-templated text.
    np.testing.assert_array_equal(data["lengths"] - data["prompt_lengths"], 12)
    np.testing.assert_array_equal(data["tokens"][:, 0], 1)

    # A re-run regenerates only what is missing: a deleted shard (identically) and, with more
    # prompts, the new shard; finished shards are skipped.
    work = tmp_path / "train"
    shutil.copytree(dataset / "train", work)
    (work / "shard-00001.npz").unlink()
    real, made = D._Generator.__call__, []
    monkeypatch.setattr(D._Generator, "__call__",
                        lambda self, rows: made.append(len(rows)) or real(self, rows))
    D.make_dataset(tp, tcfg, CharTokenizer(), PROMPTS[:8], work, **DATA_KW)
    assert made == [4]
    again = D.load_shards(work)
    for k in data:
        np.testing.assert_array_equal(again[k], data[k])
    manifest = D.make_dataset(tp, tcfg, CharTokenizer(), PROMPTS, work, **DATA_KW)
    assert made == [4, 2] and manifest["num_seqs"] == 10
    with pytest.raises(D.DatasetError, match="generated with"):
        D.make_dataset(tp, tcfg, CharTokenizer(), PROMPTS[:8], work, **{**DATA_KW, "max_new": 5})


def test_clear_errors(tiny, tmp_path):
    tcfg, tp = tiny
    with pytest.raises(D.DatasetError, match="empty"):
        D.make_dataset(tp, tcfg, CharTokenizer(), [], tmp_path / "empty", **DATA_KW)
    with pytest.raises(FileNotFoundError, match="no dataset directory"):
        D.load_shards(tmp_path / "missing")
    with pytest.raises(D.DatasetError, match="manifest"):
        D.load_shards(tmp_path / "empty")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "manifest.json").write_text(json.dumps({"format": D.FORMAT, "shards": [
        {"file": "shard-00000.npz"}]}))
    with pytest.raises(D.DatasetError, match="listed in the manifest but missing"):
        D.load_shards(broken)
    with pytest.raises(ValueError, match="unknown head"):
        TrainConfig(data_dir=".", out_dir=".", head="medusa")


def train_config(dataset, out, **changes):
    base = dict(data_dir=str(dataset / "train"), out_dir=str(out), head_layers=1, block_size=4,
                num_taps=2, steps=30, batch_size=4, num_anchors=4, lr=3e-3, warmup_steps=3,
                log_every=5, ckpt_every=10, eval_every=30, eval_batches=1, tau_prompts=2,
                tau_max_new=8, tree_budget=8, tree_width=2)
    return TrainConfig(**{**base, **changes})


@pytest.mark.parametrize("head", ["jetspec", "dflash"])
def test_loss_decreases_and_head_is_saved(tiny, dataset, tmp_path, head):
    tcfg, tp = tiny
    cfg = train_config(dataset, tmp_path, head=head, eval_dir=str(dataset / "heldout"))
    result = train(cfg, tp, tcfg, progress=False)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [5, 10, 15, 20, 25, 30]
    assert rows[-1]["loss"] < 0.6 * rows[0]["loss"]
    assert rows[-1]["acc"][0] > rows[0]["acc"][0]
    assert rows[-1]["eval"]["tau"] >= 1.0 and len(rows[-1]["eval"]["kl"]) == 3
    dcfg, dparams = HEADS[head].load(tmp_path / "head")  # its kind's reader
    assert dcfg == result.dcfg
    jax.tree.map(np.testing.assert_array_equal, dparams, result.dparams)


def test_interrupted_run_resumes_exactly(tiny, dataset, tmp_path):
    """Stopped at step 7 (last checkpoint at 5), then resumed: same params and log as one
    uninterrupted run."""
    tcfg, tp = tiny
    whole = train(train_config(dataset, tmp_path / "a", steps=12, ckpt_every=5), tp, tcfg,
                  progress=False)
    cfg = train_config(dataset, tmp_path / "b", steps=12, ckpt_every=5)
    assert train(cfg, tp, tcfg, stop_after=7, progress=False).step == 7
    # The head of the last checkpoint is there, marked incomplete (a lost machine keeps it).
    meta = json.loads((tmp_path / "b" / "head" / "metadata.json").read_text())
    assert meta["steps"] == 5 and meta["complete"] is False
    resumed = train(cfg, tp, tcfg, progress=False)
    assert resumed.step == 12
    jax.tree.map(np.testing.assert_array_equal, resumed.dparams, whole.dparams)

    def strip(rows):
        return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]

    assert strip(read_metrics(tmp_path / "b" / "metrics.jsonl")) == strip(
        read_metrics(tmp_path / "a" / "metrics.jsonl"))
    # A time limit stops after the step that passes it, checkpoints there and writes the head
    # marked incomplete; a rerun resumes from that step to the same result.
    cfg = train_config(dataset, tmp_path / "c", steps=12, ckpt_every=5)
    assert train(cfg, tp, tcfg, time_limit=1e-9, progress=False).step == 1
    meta = json.loads((tmp_path / "c" / "head" / "metadata.json").read_text())
    assert meta["steps"] == 1 and meta["complete"] is False
    resumed = train(cfg, tp, tcfg, progress=False)
    jax.tree.map(np.testing.assert_array_equal, resumed.dparams, whole.dparams)


def test_cached_features_match_online(tiny, dataset, tmp_path, monkeypatch):
    """float32 cache == the online target pass (taps, top-K); with K = V the cached-teacher
    loss equals the online one; a re-run skips finished shards; mismatches are refused."""
    from jetspec_jax.train import features as F
    from jetspec_jax.train.loss import head_loss, stored_teacher_outputs, teacher_outputs

    tcfg, tp = tiny
    dcfg = train_config(dataset, tmp_path).draft_config(tcfg)
    out = tmp_path / "feat"
    kw = dict(tap_layers=dcfg.tap_layers, top_k=tcfg.vocab_size, batch_size=3,
              dtype=np.float32, bucket=8, progress=False)
    F.cache_features(tp, tcfg, dataset / "train", out, **kw)
    feats = F.load_features(out, tcfg, dcfg.tap_layers, data_dir=dataset / "train")
    data = D.load_shards(dataset / "train")
    for k in data:
        np.testing.assert_array_equal(feats[k], data[k])

    @jax.jit  # one program, not one per operation
    def online_pass(tokens):
        hidden, taps = target_pass(tp, tcfg, tokens, dcfg.tap_layers)
        return jax.nn.log_softmax(target.lm_head(tp, tcfg, hidden)), taps

    logp, taps = map(np.asarray, online_pass(jnp.asarray(data["tokens"])))
    for b, n in enumerate(data["lengths"]):
        np.testing.assert_allclose(feats["taps"][b, :n], taps[b, :n], atol=1e-5, rtol=0)
        np.testing.assert_array_equal(feats["top_ids"][b, :n, 0], logp[b, :n].argmax(-1))
        np.testing.assert_allclose(feats["top_logp"][b, :n],
                                   -np.sort(-logp[b, :n], axis=-1), atol=1e-5)
        assert not feats["taps"][b, n:].any()

    dp = init_params(draft_specs(dcfg), jax.random.key(0))
    batch = {k: jnp.asarray(v[:4]) for k, v in feats.items()}

    @jax.jit
    def both_losses(batch):
        online = teacher_outputs(tp, tcfg, dcfg, batch, jax.random.key(1), 4)
        cached = stored_teacher_outputs(tp, tcfg, dcfg, batch, jax.random.key(1), 4)
        return online["anchors"], cached["anchors"], *(
            head_loss(dp, dcfg, tp, tcfg, batch["tokens"], t) for t in (online, cached))

    online_anchors, cached_anchors, (l1, m1), (l2, m2) = both_losses(batch)
    np.testing.assert_array_equal(online_anchors, cached_anchors)
    np.testing.assert_allclose(l1, l2, rtol=1e-5)
    np.testing.assert_allclose(m1["acc"], m2["acc"])

    made = []
    real = F._cache_shard
    monkeypatch.setattr(F, "_cache_shard", lambda *a, **k: made.append(a[1].name) or real(*a, **k))
    F.cache_features(tp, tcfg, dataset / "train", out, **kw)
    assert made == []
    shutil.rmtree(out / "shard-00001")
    F.cache_features(tp, tcfg, dataset / "train", out, **kw)
    assert made == ["shard-00001.npz"]
    again = F.load_features(out, tcfg, dcfg.tap_layers)
    for k in feats:
        np.testing.assert_array_equal(again[k], feats[k])
    with pytest.raises(F.FeatureCacheError, match="caches features"):
        F.cache_features(tp, tcfg, dataset / "train", out, **{**kw, "top_k": 4})
    with pytest.raises(F.FeatureCacheError, match="tap_layers"):
        F.load_features(out, tcfg, (0,))
    with pytest.raises(F.FeatureCacheError, match="does not match"):
        F.load_features(out, tcfg, dcfg.tap_layers, data_dir=dataset / "heldout")


def test_stored_teacher_trains_as_the_online_one(tiny, dataset, tmp_path):
    """Data made with the teacher's top-K for K = V trains step for step as the online
    teacher does (the stored KL equals the full one), and every array of a batch comes from
    the same rows (a batch whose lengths belonged to other rows would diverge at once)."""
    tcfg, tp = tiny
    stored = tmp_path / "stored"
    D.make_dataset(tp, tcfg, CharTokenizer(), PROMPTS[:8], stored, teacher_top_k=tcfg.vocab_size,
                   **DATA_KW)
    data = D.load_shards(stored)
    assert data["top_ids"].shape == (*data["tokens"].shape, tcfg.vocab_size)
    losses = {}
    for name, src in (("online", dataset / "train"), ("stored", stored)):
        cfg = train_config(dataset, tmp_path / name, data_dir=str(src), steps=6, log_every=1)
        train(cfg, tp, tcfg, progress=False)
        losses[name] = [r["loss"] for r in read_metrics(tmp_path / name / "metrics.jsonl")]
    np.testing.assert_allclose(losses["stored"], losses["online"], rtol=2e-4)


def test_draft_vocabulary_training(tiny, dataset, tmp_path):
    """--draft-vocab N: the head drafts the N most frequent answer tokens (stop tokens first),
    is saved with them, and a run continued from it keeps them even on other data."""
    tcfg, tp = tiny
    data = D.load_shards(dataset / "train")
    ids = D.frequent_tokens(data, 6, tcfg.vocab_size, tcfg.eos_token_ids)
    counts = np.bincount(D._answer_tokens(data), minlength=tcfg.vocab_size)
    assert len(ids) == 6 and set(tcfg.eos_token_ids) <= set(ids)
    others = [i for i in range(tcfg.vocab_size) if i not in ids]
    assert min(counts[[i for i in ids if i not in tcfg.eos_token_ids]]) >= max(counts[others])
    assert D.vocab_coverage(data, ids) == counts[list(ids)].sum() / counts.sum()
    for share in (0.5, 0.9, 1.0):  # the fewest frequent ids that cover the share
        n = D.covering_size(data, share, tcfg.vocab_size, multiple=1)
        top = D.frequent_tokens(data, n, tcfg.vocab_size)
        assert D.vocab_coverage(data, top) >= share - 1e-9
        assert n == 1 or D.vocab_coverage(data, D.frequent_tokens(
            data, n - 1, tcfg.vocab_size)) < share
    assert D.covering_size(data, 0.5, tcfg.vocab_size, multiple=4) % 4 == 0
    cfg = train_config(dataset, tmp_path / "a", draft_vocab=6, steps=10,
                       eval_dir=str(dataset / "heldout"))
    result = train(cfg, tp, tcfg, progress=False)
    assert result.dcfg.draft_vocab == ids
    dcfg, _ = HEADS["jetspec"].load(tmp_path / "a" / "head")
    assert dcfg == result.dcfg
    rows = read_metrics(tmp_path / "a" / "metrics.jsonl")
    assert rows[-1]["eval"]["tau"] >= 1.0
    more = train_config(dataset, tmp_path / "b", draft_vocab=6, steps=12, batch_size=2,
                        data_dir=str(dataset / "heldout"),
                        init_head=(str(tmp_path / "a" / "head"),))
    assert train(more, tp, tcfg, progress=False).dcfg.draft_vocab == ids


def test_cached_teacher_training(tiny, dataset, tmp_path, monkeypatch):
    """With feature_dir the steps never run the target, and the loss still falls."""
    from jetspec_jax.train import features as F, loss as L

    tcfg, tp = tiny
    cfg = train_config(dataset, tmp_path / "run", eval_dir=str(dataset / "heldout"),
                       feature_dir=str(tmp_path / "f-train"),
                       eval_feature_dir=str(tmp_path / "f-held"))
    taps = cfg.draft_config(tcfg).tap_layers
    for src, dst in (("train", "f-train"), ("heldout", "f-held")):
        F.cache_features(tp, tcfg, dataset / src, tmp_path / dst, tap_layers=taps, top_k=8,
                         progress=False)
    monkeypatch.setattr(L, "target_pass", None)  # any online teacher pass would fail
    train(cfg, tp, tcfg, progress=False)
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert rows[-1]["loss"] < 0.6 * rows[0]["loss"]
    assert rows[-1]["acc"][0] > rows[0]["acc"][0]
    assert rows[-1]["eval"]["tau"] >= 1.0 and rows[-1]["eval"]["kl"][0] < rows[0]["kl"][0]


# ---- training at scale: chunked anchors, head shards, resuming from weights --------------------


def test_chunked_anchor_loss_equals_one_pass(tiny, dataset):
    """Anchors in chunks of 2 (checkpointed lax.map) give the loss, metrics and gradients of
    one pass over all 4, with a depth-1 weight."""
    from jetspec_jax.train.loss import depth_weights, head_loss, teacher_outputs

    tcfg, tp = tiny
    dcfg = train_config(dataset, ".").draft_config(tcfg)
    batch = {k: jnp.asarray(v[:4]) for k, v in D.load_shards(dataset / "train").items()}
    dp = init_params(draft_specs(dcfg), jax.random.key(0))

    @functools.partial(jax.jit, static_argnums=0)
    def loss_grad(chunk):
        def f(dp):
            teach = teacher_outputs(tp, tcfg, dcfg, batch, jax.random.key(1), 4)
            return head_loss(dp, dcfg, tp, tcfg, batch["tokens"], teach, 3.0,
                             depth1_weight=2.0, anchor_chunk=chunk)
        return jax.value_and_grad(f, has_aux=True)(dp)

    (l1, m1), g1 = loss_grad(None)
    (l2, m2), g2 = loss_grad(2)
    np.testing.assert_allclose(l2, l1, rtol=1e-5)
    for k in ("kl", "acc", "count"):
        np.testing.assert_allclose(m2[k], m1[k], rtol=1e-5, atol=1e-7)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), g2, g1)
    assert float(l1) > 0 and np.asarray(depth_weights(3, 3.0, 2.0))[0] == 2.0
    with pytest.raises(ValueError, match="anchor_chunk 3 must be >= 1 and divide num_anchors 4"):
        train_config(dataset, ".", anchor_chunk=3)


def test_online_loss_equals_the_teacher_logits_at_each_slot(tiny, dataset):
    """The online loss (teacher log-probs made once per position, gathered per chunk) equals
    `distill_loss` over the head's logits and the target's logits taken slot by slot."""
    from jetspec_jax.train.loss import head_loss, teacher_outputs

    tcfg, tp = tiny
    dcfg = train_config(dataset, ".").draft_config(tcfg)
    batch = {k: jnp.asarray(v[:4]) for k, v in D.load_shards(dataset / "train").items()}
    dp = init_params(draft_specs(dcfg), jax.random.key(0))

    @jax.jit
    def both():
        teach = teacher_outputs(tp, tcfg, dcfg, batch, jax.random.key(1), 4)
        hidden, taps = target_pass(tp, tcfg, batch["tokens"], dcfg.tap_layers)
        pos = jnp.clip(teach["pos"], 0, hidden.shape[1] - 1)
        at_slots = jax.vmap(lambda h, p: target.lm_head(tp, tcfg, h[p]))(hidden, pos)
        ref = distill_loss(head_logits(dp, dcfg, tp, tcfg, taps, batch["tokens"],
                                       teach["anchors"]), at_slots, teach["valid"], 3.0)
        return ref, head_loss(dp, dcfg, tp, tcfg, batch["tokens"], teach, 3.0, anchor_chunk=2)

    (l_ref, m_ref), (l, m) = both()
    np.testing.assert_allclose(l, l_ref, rtol=1e-5)
    for k in ("kl", "acc", "count"):
        np.testing.assert_allclose(m[k], m_ref[k], rtol=1e-5, atol=1e-7)
    assert float(l) > 0


def test_head_shards_round_trip_and_fit_the_limit(tmp_path):
    """A head as flat safetensors files: each within the limit, loaded back equal from the
    folder or the files; a missing file is named. The 5-layer SmolLM2 head in bfloat16 takes
    3 files of <= 15 MiB."""
    from jetspec_jax.cli import main
    from jetspec_jax.io.checkpoints import CheckpointError
    from jetspec_jax.io.heads import read_any_draft, read_draft_shards, save_draft
    from jetspec_jax.model import config

    tcfg, _ = tiny_target("dense", seed=2, vocab=16)
    dcfg, dp = tiny_head(tcfg)
    save_draft(tmp_path / "orbax", dp, dcfg, metadata={"steps": 3})
    assert main(["convert", "--head", str(tmp_path / "orbax"), str(tmp_path / "sh"),
                 "--dtype", "float32", "--shard-mib", str(40_000 / 2**20)]) == 0
    files = sorted((tmp_path / "sh").iterdir())
    assert len(files) > 2 and all(f.stat().st_size <= 40_000 for f in files)
    for got_cfg, got in (read_any_draft(tmp_path / "sh"), read_draft_shards(files)[:2]):
        assert got_cfg == dcfg
        jax.tree.map(np.testing.assert_array_equal, got, dp)
    assert read_draft_shards(files)[2]["steps"] == 3
    with pytest.raises(CheckpointError, match=f"has {len(files)} files, {len(files) - 1} are"):
        read_draft_shards(files[1:])

    big = draft_head.draft_config_for(config.smollm2_135m(), num_layers=5)
    zeros = jax.tree.map(lambda s: np.zeros(s.shape, jnp.bfloat16), draft_specs(big),
                         is_leaf=lambda x: hasattr(x, "shape"))
    out = save_draft(tmp_path / "big", zeros, big, max_bytes=15 * 2**20)
    sizes = [f.stat().st_size for f in out.iterdir()]
    assert len(sizes) == 3 and max(sizes) <= 15 * 2**20 and sum(sizes) < 50e6


def test_init_head_continues_a_run_with_a_fresh_optimizer(tiny, dataset, tmp_path):
    """A run restarted from its step-10 weights alone (bfloat16 files), a fresh optimizer
    re-warmed over 3 steps: the step count, schedule and data order continue, and its loss
    ends near the uninterrupted run's, far below a fresh head's."""
    from jetspec_jax.io.heads import save_draft
    from jetspec_jax.train.state import restore_state
    from jetspec_jax.train.trainer import make_optimizer

    tcfg, tp = tiny
    cfg = train_config(dataset, tmp_path / "whole", steps=20, tau_prompts=0, keep_ckpts=2)
    whole = train(cfg, tp, tcfg, progress=False)
    state, _ = restore_state(tmp_path / "whole" / "checkpoints" / "step_00000010",
                             {"params": whole.dparams, "opt_state": make_optimizer(cfg)[0].init(
                                 whole.dparams)})
    save_draft(tmp_path / "w10", state["params"], whole.dcfg, max_bytes=40_000,
               dtype=jnp.bfloat16, metadata={"steps": 10})
    files = tuple(str(f) for f in sorted((tmp_path / "w10").iterdir()))
    # start_step defaults to the step recorded in the files
    again = dataclasses.replace(cfg, out_dir=str(tmp_path / "again"), init_head=files)
    assert train(again, tp, tcfg, progress=False).step == 20
    a, b = (read_metrics(tmp_path / d / "metrics.jsonl") for d in ("whole", "again"))
    assert [r["step"] for r in b] == [15, 20]
    assert b[-1]["loss"] < 1.3 * a[-1]["loss"] and b[0]["loss"] < 0.7 * a[0]["loss"]
    assert all(r["tok_s"] > 0 and 0 < r["mfu"] < 1 for r in a[1:])
    _, schedule = make_optimizer(again, 10)  # re-warmed from step 10: 1/3 of the rate at 10
    np.testing.assert_allclose(schedule(10), make_optimizer(cfg)[1](10) / 3, rtol=1e-6)
    with pytest.raises(ValueError, match="start_step continues a run"):
        dataclasses.replace(cfg, start_step=5)


def test_final_norm_from_the_target(tiny, dataset):
    from jetspec_jax.train.trainer import fresh_params

    tcfg, tp = tiny
    cfg = train_config(dataset, ".", norm_from_target=True)
    tp = {**tp, "final_norm": tp["final_norm"] * 1.5}  # not the head's ones
    specs = draft_specs(cfg.draft_config(tcfg))
    np.testing.assert_array_equal(fresh_params(cfg, specs, tp)["norm"], tp["final_norm"])
    plain = fresh_params(dataclasses.replace(cfg, norm_from_target=False), specs, tp)
    np.testing.assert_array_equal(plain["norm"], 1.0)


def test_step_flops_match_the_compiled_forwards():
    """The logged model FLOPs (`throughput.step_flops`) agree with XLA's count of the jitted
    head and target forwards to within their elementwise work (a few per cent)."""
    from jetspec_jax.train.throughput import step_flops

    tcfg, tp = tiny_target("dense", seed=0, vocab=256)
    dcfg, dp = tiny_head(tcfg, block_size=4, num_layers=2)
    b, t, a = 2, 32, 4
    tokens = jnp.zeros((b, t), jnp.int32)
    anchors = jnp.tile(jnp.arange(a, dtype=jnp.int32)[None], (b, 1))
    taps = jnp.zeros((b, t, 2 * tcfg.hidden_size))

    def xla_flops(fn, *args):
        cost = jax.jit(fn).lower(*args).compile().cost_analysis()
        return (cost[0] if isinstance(cost, list) else cost)["flops"]

    head = xla_flops(lambda dp: head_logits(dp, dcfg, tp, tcfg, taps, tokens, anchors), dp)
    teacher = xla_flops(lambda tp: target.lm_head(
        tp, tcfg, target_pass(tp, tcfg, tokens, dcfg.tap_layers)[0]), tp)
    got = step_flops(tcfg, dcfg, batch=b, seq_len=t, anchors=a)
    assert 0.9 * head < got["head"] <= head and 0.9 * teacher < got["target"] <= teacher
    assert got["step"] == got["target"] + 3 * got["head"]
    assert step_flops(tcfg, dcfg, batch=b, seq_len=t, anchors=a, teacher="features")[
        "target"] == 0
    # A stored teacher: the target up to its last tap, no LM head; a draft vocabulary of 64
    # ids: the head's LM head over 64 rows.
    stored = xla_flops(lambda tp: target_pass(tp, tcfg, tokens, dcfg.tap_layers)[1], tp)
    got = step_flops(tcfg, dcfg, batch=b, seq_len=t, anchors=a, teacher="stored")
    assert 0.9 * stored < got["target"] <= stored
    small = dataclasses.replace(dcfg, draft_vocab=tuple(range(0, 256, 4)))
    head = xla_flops(lambda dp: head_logits(dp, small, tp, tcfg, taps, tokens, anchors), dp)
    got = step_flops(tcfg, small, batch=b, seq_len=t, anchors=a)["head"]
    assert 0.9 * head < got <= head

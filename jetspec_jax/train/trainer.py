"""Training a draft head on self-distillation shards.

    result = train(TrainConfig(data_dir="data/train", eval_dir="data/heldout",
                               out_dir="runs/smollm2"), tparams, tcfg)

The target is frozen: only the head's params get gradients (AdamW, linear warm-up then cosine
decay, global-norm clipping). Batches come from a seeded sampler whose RNG state is saved with
each checkpoint, and anchors from a key folded with the step, so a run resumed from its latest
checkpoint continues exactly as an uninterrupted one (its metric log too, when ckpt_every is a
multiple of log_every: a log window restarts at a resume). Data made with a teacher top-K
(`data.make_dataset(teacher_top_k=K)`) gives each step its teacher without the target's LM
head (`loss.stored_teacher_outputs`); with `feature_dir` (a cache made by
`features.cache_features` from data_dir, with the head's tap layers) a step does not run the
target at all: taps come from the cache too. Held-out KL uses `eval_feature_dir` when given,
else the held-out data as it comes; tau always runs the real target. With `draft_vocab` a block
head drafts only the training answers' most frequent tokens (`choose_draft_vocab`). Heads
(`head_kinds.py`): "jetspec" (causal block), "dflash" (bidirectional block, same
architecture), and any kind registered there. Without a checkpoint,
`init_head` starts from a head's weights alone (its safetensors files, `io/shards.py`) with a
fresh optimizer re-warmed at `start_step`: a long run cut into short calls that keep only the
weights. `mesh="data=N"` splits the batch over N devices (`parallel.py`).
Writes under out_dir:
  metrics.jsonl   {"step", "loss", "kl" [J], "acc" [J], "lr", "grad_norm", "step_s", "tok_s",
                  "mfu", "time"} per log window (`throughput.py`); eval rows add
                  {"eval": {"loss", "kl", "acc", "tau"}}
  checkpoints/    the last `keep_ckpts` train states
  head/           the final head (its kind's `save`: `head_io.save_draft` for block heads)
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from tqdm.auto import tqdm

from jetspec_jax.decode.sampling import Sampler
from jetspec_jax.decode.loop import Loop
from jetspec_jax.decode.speculative import TreeSpec, spec_generate, working_slots
from jetspec_jax.draft.drafter import HeadConfig
from jetspec_jax.draft.head import DraftConfig
from jetspec_jax.io.checkpoints import read_info
from jetspec_jax.io.heads import read_any_draft
from jetspec_jax.io.shards import is_shard_export, read_shards
from jetspec_jax.model.config import ModelConfig
from jetspec_jax.model.kernels import choose
from jetspec_jax.model.params import check_params, init_params, unflatten
from jetspec_jax.options import ATTN_IMPLS, HEAD_ATTENTION, check_kernel_name
from jetspec_jax.train.head_kinds import HEADS
from jetspec_jax.train.data import DatasetError, covering_size, frequent_tokens, load_shards
from jetspec_jax.train.features import load_features
from jetspec_jax.train.loss import head_loss, stored_teacher_outputs, teacher_outputs
from jetspec_jax.train.state import restore_state, save_state, state_dirs
from jetspec_jax.train.parallel import data_mesh, data_parallel, place
from jetspec_jax.train.throughput import Throughput


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    data_dir: str
    out_dir: str
    eval_dir: str | None = None
    feature_dir: str | None = None  # cached teacher (features.py) of data_dir: no target pass
    eval_feature_dir: str | None = None  # cached teacher of eval_dir (feature_dir mode only)
    head: str = "jetspec"  # one of HEADS
    head_layers: int = 5  # (block heads)
    block_size: int = 16  # draft depth block_size - 1 for every head
    num_taps: int = 5
    mask_token_id: int | None = None  # None: learned mask embedding (recommended, see loss.py)
    # optimisation
    steps: int = 2000
    batch_size: int = 8
    num_anchors: int = 16
    lr: float = 6e-4
    warmup_steps: int = 100
    weight_decay: float = 0.01
    clip_norm: float = 1.0
    gamma: float | None = 7.0
    depth1_weight: float | None = None  # replaces depth 1's weight exp(0) = 1 (`loss.py`)
    norm_from_target: bool = False  # a fresh head's final norm starts as the target's
    # the head drafts only this many token ids, the training answers' most frequent
    # (`frequent_tokens`); kept from the checkpoint or init_head when they have one of this size
    draft_vocab: int | None = None
    draft_vocab_coverage: float | None = None  # or the fewest ids covering this answer share
    teacher_top_k: int = 32  # an online teacher's K when the head has a draft vocabulary
    anchor_chunk: int | None = 32  # anchors per chunk of the loss (memory; must divide A)
    # the frozen target's attention in each step (`kernels.choose`: "auto" takes the GPU's
    # kernels there, 11% faster a step than XLA's on an H100); bench.train_step times them
    target_attention: str = "auto"
    # the head's attention in a step: "cudnn" (cuDNN's fused attention, bfloat16 inputs; half
    # the step's time on an H100) or "reference" (XLA, float32); "auto": cudnn on one GPU
    head_attention: str = "auto"
    seed: int = 0
    # resuming from a head's weights alone (no checkpoint in out_dir): a fresh optimizer,
    # re-warmed over warmup_steps, the schedule and the data order continued at start_step
    init_head: tuple[str, ...] | None = None  # a head directory, or its safetensors files
    start_step: int | None = None  # None: the step recorded with init_head's weights
    mesh: str | None = None  # "data=N": batch split over N devices, params replicated
    peak_flops: float = 790e12  # per device, for the logged model-FLOP utilisation
    # bookkeeping
    log_every: int = 10
    ckpt_every: int = 200
    keep_ckpts: int = 2
    eval_every: int = 200
    eval_batches: int = 4
    tau_prompts: int = 4
    tau_max_new: int = 64
    tree_budget: int = 64
    tree_width: int = 7

    def __post_init__(self):
        if self.head not in HEADS:
            raise ValueError(f"unknown head {self.head!r}; choose from {sorted(HEADS)} (or "
                             "register its kind: `head_kinds.register`)")
        for name in ("steps", "batch_size", "num_anchors", "log_every", "ckpt_every",
                     "keep_ckpts", "eval_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.start_step is not None and not 0 <= self.start_step < self.steps:
            raise ValueError(f"start_step must be in [0, steps={self.steps}), got "
                             f"{self.start_step}")
        if self.start_step is not None and not self.init_head:
            raise ValueError("start_step continues a run from a head's weights: give init_head")
        if self.anchor_chunk is not None and (
                self.anchor_chunk < 1 or (self.num_anchors > self.anchor_chunk
                                          and self.num_anchors % self.anchor_chunk)):
            raise ValueError(f"anchor_chunk {self.anchor_chunk} must be >= 1 and divide "
                             f"num_anchors {self.num_anchors}")
        if self.mesh is not None and self.batch_size % data_parallel(self.mesh):
            raise ValueError(f"batch_size {self.batch_size} must be a multiple of the "
                             f"{data_parallel(self.mesh)} devices of mesh {self.mesh!r}")
        check_kernel_name("attention", self.target_attention, ATTN_IMPLS)
        if self.head_attention not in HEAD_ATTENTION:
            raise ValueError(f"head_attention must be one of {HEAD_ATTENTION}, got "
                             f"{self.head_attention!r}")
        if self.head_attention == "cudnn" and not self.block_head:
            raise ValueError(f"head_attention {self.head_attention!r} needs a block head "
                             f"(jetspec or dflash), not {self.head!r}")
        if self.eval_feature_dir and not (self.feature_dir and self.eval_dir):
            raise ValueError("eval_feature_dir needs feature_dir and eval_dir")
        wants_vocab = self.draft_vocab is not None or self.draft_vocab_coverage is not None
        if wants_vocab and not self.block_head:
            raise ValueError(f"a draft vocabulary needs a block head (jetspec or dflash), not "
                             f"{self.head!r}")
        if self.draft_vocab is not None and self.draft_vocab < 1:
            raise ValueError(f"draft_vocab must be >= 1, got {self.draft_vocab}")
        if self.draft_vocab is not None and self.draft_vocab_coverage is not None:
            raise ValueError("give draft_vocab (a size) or draft_vocab_coverage, not both")
        if self.teacher_top_k < 1:
            raise ValueError(f"teacher_top_k must be >= 1, got {self.teacher_top_k}")

    @property
    def block_head(self) -> bool:
        """A JetSpec or DFlash block head (what draft vocabularies and cuDNN attention need)."""
        return HEADS[self.head].config_type is DraftConfig

    def draft_config(self, tcfg: ModelConfig,
                     draft_vocab: tuple[int, ...] | None = None) -> HeadConfig:
        """The head this config trains; draft_vocab: its ids, when `self.draft_vocab` is set."""
        dcfg = HEADS[self.head].make_config(self, tcfg)
        if draft_vocab is not None:
            dcfg = dataclasses.replace(dcfg, draft_vocab=draft_vocab)
            dcfg.check_target(tcfg)
        return dcfg


@dataclasses.dataclass
class TrainResult:
    dparams: dict
    dcfg: HeadConfig
    step: int
    out_dir: Path


class BatchSampler:
    """Shuffled epochs of sequence ids; `state()` restores the exact sequence of batches."""

    def __init__(self, num_seqs: int, batch_size: int, seed: int):
        if num_seqs < batch_size:
            raise DatasetError(f"{num_seqs} training sequences are fewer than batch size "
                               f"{batch_size}")
        self.n, self.bs = num_seqs, batch_size
        self.rng = np.random.default_rng(seed)
        self._new_epoch()

    def _new_epoch(self):
        self.epoch_state = self.rng.bit_generator.state  # before the permutation is drawn
        self.perm, self.pos = self.rng.permutation(self.n), 0

    def next(self) -> np.ndarray:
        if self.pos + self.bs > self.n:
            self._new_epoch()
        idx = self.perm[self.pos:self.pos + self.bs]
        self.pos += self.bs
        return idx

    def state(self) -> dict:
        return {"rng": self.epoch_state, "pos": self.pos}

    def restore(self, state: dict) -> None:
        self.rng.bit_generator.state = state["rng"]
        self._new_epoch()
        self.pos = state["pos"]


def make_optimizer(cfg: TrainConfig, offset: int = 0):
    """AdamW over a warm-up + cosine schedule of the global step. offset > 0: the optimizer
    starts fresh at global step `offset` (its own count at 0), so the schedule is shifted by
    it and re-warmed linearly over warmup_steps from there."""
    base = optax.warmup_cosine_decay_schedule(
        0.0, cfg.lr, min(cfg.warmup_steps, cfg.steps - 1), cfg.steps, end_value=0.1 * cfg.lr)

    def schedule(step):
        if not offset:
            return base(step)
        return base(step) * jnp.clip((step - offset + 1) / max(cfg.warmup_steps, 1), 0.0, 1.0)

    decay_mask = lambda params: jax.tree.map(lambda x: x.ndim >= 2, params)  # noqa: E731
    tx = optax.chain(optax.clip_by_global_norm(cfg.clip_norm),
                     optax.adamw(lambda count: schedule(count + offset),
                                 weight_decay=cfg.weight_decay, mask=decay_mask))
    return tx, schedule


def check_devices(cfg: TrainConfig) -> None:
    """Raises ValueError, naming the setting, when cfg needs a device this machine lacks (the
    CLI calls it before loading anything)."""
    backend = jax.default_backend()
    if cfg.head_attention == "cudnn" and backend != "gpu":
        raise ValueError(f"head_attention 'cudnn' needs a GPU; this machine has only "
                         f"{backend.upper()} devices; use auto or reference")


def head_attention(cfg: TrainConfig) -> str:
    """cfg.head_attention with "auto" resolved: cudnn for a block head on one GPU (a data
    mesh keeps XLA's, whose partitioning is tested)."""
    if cfg.head_attention != "auto":
        return cfg.head_attention
    one_gpu = jax.default_backend() == "gpu" and cfg.mesh is None
    return "cudnn" if cfg.block_head and one_gpu else "reference"


def make_steps(cfg: TrainConfig, tcfg: ModelConfig, dcfg: HeadConfig, tx,
               stored: bool = False):
    """Jitted (train_step, eval_step); only dparams is differentiated. stored: batches carry
    a top-K teacher (`data.make_dataset(teacher_top_k=K)`, or a feature cache with the taps
    too, `features.load_features`), so the target runs no LM head (no pass at all with taps).
    On a data mesh the inputs arrive placed (`place`) and jit partitions the step: the batch
    over "data", the gradients reduced across it, params and optimizer state replicated."""
    top_k = (min(cfg.teacher_top_k, tcfg.vocab_size)
             if getattr(dcfg, "draft_vocab", None) is not None else None)
    kernels = choose(cfg.target_attention, sharded=cfg.mesh is not None)
    check_devices(cfg)
    attention = head_attention(cfg)

    def teacher(tparams, batch, key):  # outside the gradient: the target is frozen
        if stored:
            return stored_teacher_outputs(tparams, tcfg, dcfg, batch, key, cfg.num_anchors,
                                          kernels)
        return teacher_outputs(tparams, tcfg, dcfg, batch, key, cfg.num_anchors, top_k, kernels)

    def loss_and_metrics(dparams, tparams, batch, teach):
        return head_loss(dparams, dcfg, tparams, tcfg, batch["tokens"], teach, cfg.gamma,
                         depth1_weight=cfg.depth1_weight, anchor_chunk=cfg.anchor_chunk,
                         attention=attention)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(dparams, opt_state, tparams, batch, key):
        (loss, m), grads = jax.value_and_grad(loss_and_metrics, has_aux=True)(
            dparams, tparams, batch, teacher(tparams, batch, key))
        updates, opt_state = tx.update(grads, opt_state, dparams)
        return (optax.apply_updates(dparams, updates), opt_state,
                {"loss": loss, "grad_norm": optax.tree.norm(grads), **m})

    @jax.jit
    def eval_step(dparams, tparams, batch, key):
        loss, m = loss_and_metrics(dparams, tparams, batch, teacher(tparams, batch, key))
        return {"loss": loss, **m}

    return train_step, eval_step


def _mean_metrics(rows: list[dict]) -> dict:
    """Averages a window of step metrics; per-depth values weighted by their slot counts."""
    rows = jax.device_get(rows)
    count = np.sum([r["count"] for r in rows], axis=0)
    per_depth = lambda k: (np.sum([r[k] * r["count"] for r in rows], 0)  # noqa: E731
                           / np.maximum(count, 1)).tolist()
    out = {k: float(np.mean([r[k] for r in rows])) for k in ("loss", "grad_norm") if k in rows[0]}
    return {**out, "kl": per_depth("kl"), "acc": per_depth("acc")}


def evaluate(cfg: TrainConfig, tcfg, dcfg, eval_step, dparams, tparams, data,
             mesh: Mesh | None = None, single_tparams=None) -> dict:
    """Held-out KL / accuracy on fixed batches and anchors, and greedy SD's tau (on one
    device: single_tparams is the target there when the step runs on a mesh)."""
    n = len(data["lengths"])
    rows = []
    for i in range(cfg.eval_batches):
        idx = np.arange(i * cfg.batch_size, (i + 1) * cfg.batch_size) % n
        batch = place(mesh, {k: jnp.asarray(v[idx]) for k, v in data.items()}, batch=True)
        rows.append(eval_step(dparams, tparams, batch, jax.random.key(i)))
    out = _mean_metrics(rows)
    if cfg.tau_prompts:
        if mesh is not None:
            dparams = jax.device_put(dparams, jax.devices()[0])
            tparams = single_tparams
        out["tau"] = mean_accepted_length(cfg, tcfg, dcfg, dparams, tparams, data)
    return out


def mean_accepted_length(cfg: TrainConfig, tcfg, dcfg, dparams, tparams, data) -> float:
    """Tokens committed per round by greedy speculative decoding of held-out prompts."""
    idx = np.arange(cfg.tau_prompts) % len(data["lengths"])
    plens = data["prompt_lengths"][idx]
    prompt, plens = jnp.asarray(data["tokens"][idx, :plens.max()]), jnp.asarray(plens)
    slots = int(plens.max()) + cfg.tau_max_new + working_slots(cfg.tree_budget, cfg.block_size)
    loop = Loop(max_new=cfg.tau_max_new, num_slots=slots, stop_ids=tcfg.eos_token_ids)
    _, stats = spec_generate(tparams, dparams, prompt, plens, jax.random.key(0), tcfg=tcfg,
                             dcfg=dcfg, tree_spec=TreeSpec(cfg.tree_budget, cfg.tree_width),
                             sampler=Sampler(), loop=loop)
    return float(np.sum(stats.accepted) / max(int(np.sum(stats.rounds)), 1))


def load_init_head(cfg: TrainConfig, dcfg, specs) -> tuple[dict, dict, tuple | None]:
    """(float32 params, their metadata: "steps" trained and "train_seconds" when recorded, their
    draft vocabulary) of cfg.init_head: an orbax
    head directory, or the safetensors files of its kind's `save` (a folder, or the files),
    which must hold a head of this config."""
    paths = [Path(p) for p in cfg.init_head]
    src = paths[0] if len(paths) == 1 else paths
    kind = HEADS[cfg.head].checkpoint_kind
    if len(paths) == 1 and (paths[0] / "metadata.json").exists():
        got, params = HEADS[cfg.head].load(src)
        meta = read_info(src)[1]
    elif is_shard_export(src):
        got_kind, config, flat, meta = read_shards(src)
        if got_kind != kind:
            raise ValueError(f"init_head {cfg.init_head} holds a {got_kind!r} head, not {kind!r}")
        got = type(dcfg).from_dict(config)
        params = unflatten(flat, specs, f"init_head {cfg.init_head}")
    else:  # a reference-format head
        (got, params), meta = read_any_draft(src), {}
    mine, theirs = dcfg.to_dict(), got.to_dict()
    diff = {k for k in mine.keys() | theirs.keys()
            if k != "draft_vocab" and mine.get(k) != theirs.get(k)}  # the weights fit any
    if diff:
        raise ValueError(f"init_head {cfg.init_head} is another head than this config makes "
                         f"(differs in {sorted(diff)})")
    check_params(params, specs, f"init_head {cfg.init_head}")
    return (jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params), meta,
            getattr(got, "draft_vocab", None))


def choose_draft_vocab(cfg: TrainConfig, data, tcfg: ModelConfig,
                       previous: tuple[int, ...] | None) -> tuple[int, ...] | None:
    """The head's draft vocabulary: None without cfg.draft_vocab(_coverage); else the one the run
    already has (previous, from its checkpoint or init_head) unless cfg.draft_vocab asks for
    another size, so every stretch of a long run drafts the same ids; else the training
    answers' most frequent tokens, cfg.draft_vocab of them or as many as cover
    cfg.draft_vocab_coverage of the answers."""
    if cfg.draft_vocab is None and cfg.draft_vocab_coverage is None:
        return None
    if previous is not None and cfg.draft_vocab in (None, len(previous)):
        return tuple(previous)
    size = cfg.draft_vocab or covering_size(data, cfg.draft_vocab_coverage, tcfg.vocab_size)
    return frequent_tokens(data, size, tcfg.vocab_size, tcfg.eos_token_ids)


def fresh_params(cfg: TrainConfig, specs, tparams) -> dict:
    """A new head's params (seeded); with norm_from_target its final norm is the target's."""
    dparams = init_params(specs, jax.random.key(cfg.seed))
    if cfg.norm_from_target:
        dparams["norm"] = jnp.asarray(tparams["final_norm"], dparams["norm"].dtype)
    return dparams


def train(cfg: TrainConfig, tparams, tcfg: ModelConfig, *, stop_after: int | None = None,
          time_limit: float | None = None, progress: bool = True) -> TrainResult:
    """Trains (or resumes training of) a head; `stop_after` ends the run early at that step,
    as an interruption would (tests and time-sliced jobs). `time_limit` (seconds of this call)
    ends it at the first step past the limit: a checkpoint is saved (a rerun resumes there)
    and the head so far is written, marked incomplete in its metadata (as it is with every
    checkpoint before the last step). A checkpoint in out_dir wins over cfg.init_head (a rerun
    of the same command resumes from it)."""
    out = Path(cfg.out_dir)
    dcfg = cfg.draft_config(tcfg)  # its draft vocabulary, if any, is chosen below
    specs = HEADS[cfg.head].specs(dcfg)
    ckpts = state_dirs(out / "checkpoints")
    init, start_step, previous_vocab = None, cfg.start_step, None
    if cfg.init_head and not ckpts:
        init, init_meta, previous_vocab = load_init_head(cfg, dcfg, specs)
        trained = init_meta.get("steps")
        if start_step is None:
            if trained is None:
                raise ValueError(f"init_head {cfg.init_head} records no step count: give "
                                 "start_step")
            start_step = int(trained)
        if start_step >= cfg.steps:
            raise ValueError(f"init_head was trained {start_step} steps, not fewer than "
                             f"steps={cfg.steps}: nothing to train")
    mesh = data_mesh(cfg.mesh) if cfg.mesh else None
    if cfg.feature_dir:
        data = load_features(cfg.feature_dir, tcfg, dcfg.tap_layers, data_dir=cfg.data_dir)
    else:
        data = load_shards(cfg.data_dir)
    eval_data = None
    if cfg.eval_feature_dir:
        eval_data = load_features(cfg.eval_feature_dir, tcfg, dcfg.tap_layers,
                                  data_dir=cfg.eval_dir)
    elif cfg.eval_dir:
        eval_data = load_shards(cfg.eval_dir)
    dparams = fresh_params(cfg, specs, tparams)
    opt_state = make_optimizer(cfg)[0].init(dparams)  # its structure does not depend on offset
    sampler = BatchSampler(len(data["lengths"]), cfg.batch_size, cfg.seed)
    step, elapsed, offset = 0, 0.0, 0
    if ckpts:
        state, meta = restore_state(ckpts[-1], {"params": dparams, "opt_state": opt_state})
        previous_vocab = meta["draft_config"].get("draft_vocab")
    dcfg = cfg.draft_config(tcfg, choose_draft_vocab(cfg, data, tcfg, previous_vocab))
    if ckpts:
        if meta["draft_config"] != json.loads(json.dumps(dcfg.to_dict())):
            raise ValueError(f"{ckpts[-1]} holds a head {meta['draft_config']}, not the one "
                             f"this config makes: use another out_dir")
        dparams, opt_state = state["params"], state["opt_state"]
        step, elapsed = meta["step"], meta["elapsed"]
        offset = meta.get("schedule_offset", 0)
        sampler.restore(meta["data_sampler"])
    elif init is not None:
        dparams, step, offset = init, start_step, start_step
        if start_step == trained:  # the same run continued: its clock too
            elapsed = float(init_meta.get("train_seconds", 0.0))
        for _ in range(step):  # the batches an uninterrupted run would have drawn so far
            sampler.next()
    tx, schedule = make_optimizer(cfg, offset)
    log = MetricLog(out / "metrics.jsonl", keep_until=step)
    stored = "top_ids" in data
    train_step, eval_step = make_steps(cfg, tcfg, dcfg, tx, stored=stored)
    if eval_data is not None and ("top_ids" in eval_data) != stored:  # held-out KL as it comes
        _, eval_step = make_steps(cfg, tcfg, dcfg, tx, stored="top_ids" in eval_data)
    single_tparams = tparams
    dparams, opt_state, tparams = place(mesh, (dparams, opt_state, tparams))
    base_key = jax.random.key(cfg.seed + 1)
    start, window = time.time() - elapsed, []
    seq_len = data["tokens"].shape[1]
    count_flops = HEADS[cfg.head].step_flops
    flops = None if count_flops is None else count_flops(
        tcfg, dcfg, batch=cfg.batch_size, seq_len=seq_len, anchors=cfg.num_anchors,
        anchor_chunk=cfg.anchor_chunk,
        teacher="features" if "taps" in data else "stored" if stored else "online")["step"]
    speed = Throughput(cfg.batch_size * seq_len, flops,
                       cfg.peak_flops * (data_parallel(cfg.mesh) if cfg.mesh else 1))
    bar = tqdm(total=cfg.steps, initial=step, desc="train head", disable=not progress)
    deadline, out_of_time = (time.time() + time_limit if time_limit else None), False
    first = True
    while step < cfg.steps and not out_of_time and (stop_after is None or step < stop_after):
        rows = sampler.next()  # one draw for every array: they describe the same sequences
        batch = place(mesh, {k: jnp.asarray(v[rows]) for k, v in data.items()}, True)
        dparams, opt_state, m = train_step(dparams, opt_state, tparams, batch,
                                           jax.random.fold_in(base_key, step))
        step += 1
        window.append(m)
        bar.update()
        if first:  # compiled now: time from here
            jax.block_until_ready(m)
            speed.reset()
            first = False
        else:
            speed.steps += 1
        row = {}
        if step % cfg.log_every == 0 or step == cfg.steps:
            row = {**_mean_metrics(window), "lr": float(schedule(step - 1)), **speed.row()}
            window = []
            bar.set_postfix(loss=f"{row['loss']:.3f}", acc1=f"{row['acc'][0]:.2f}")
        if eval_data is not None and (step % cfg.eval_every == 0 or step == cfg.steps):
            row["eval"] = evaluate(cfg, tcfg, dcfg, eval_step, dparams, tparams, eval_data,
                                   mesh, single_tparams)
        if row:
            log.write({"step": step, **row, "time": time.time() - start})
            speed.reset()
        out_of_time = bool(deadline) and time.time() > deadline
        if step % cfg.ckpt_every == 0 or step == cfg.steps or out_of_time:
            save_state(out / "checkpoints", step, {"params": dparams, "opt_state": opt_state},
                       dataclasses.asdict(cfg), {"data_sampler": sampler.state(),
                                                 "elapsed": time.time() - start,
                                                 "draft_config": dcfg.to_dict(),
                                                 "schedule_offset": offset},
                       cfg.keep_ckpts)
            # The head so far with each checkpoint: a run whose machine is lost leaves a
            # usable head at its last checkpoint, not only a state to resume.
            HEADS[cfg.head].save(out / "head", jax.device_get(dparams), dcfg, overwrite=True,
                                 metadata={"steps": step, "complete": step == cfg.steps,
                                           "train_seconds": round(time.time() - start, 1),
                                           "train_config": dataclasses.asdict(cfg)})
    bar.close()
    return TrainResult(dparams=dparams, dcfg=dcfg, step=step, out_dir=out)


class MetricLog:
    """Append-only JSONL; on resume, rows past the restored step (written after the last
    checkpoint, then lost) are dropped so the log reads as one uninterrupted run."""

    def __init__(self, path: Path, keep_until: int):
        path.parent.mkdir(parents=True, exist_ok=True)
        rows = [r for r in read_metrics(path) if r["step"] <= keep_until] if path.exists() else []
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        self.path = path

    def write(self, row: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")


def read_metrics(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]

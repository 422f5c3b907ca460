"""Training a draft head on self-distillation shards.

    result = train(TrainConfig(data_dir="data/train", eval_dir="data/heldout",
                               out_dir="runs/smollm2"), tparams, tcfg)

The target is frozen: only the head's params get gradients (AdamW, linear warm-up then cosine
decay, global-norm clipping). Batches come from a seeded sampler whose RNG state is saved with
each checkpoint, and anchors from a key folded with the step, so a run resumed from its latest
checkpoint continues exactly as an uninterrupted one (its metric log too, when ckpt_every is a
multiple of log_every: a log window restarts at a resume). With `feature_dir` (a cache made by
`features.cache_features` from data_dir, with the head's tap layers) a step does not run the
target: taps and a top-K teacher come from the cache (`loss.cached_teacher_outputs`); held-out
KL then uses `eval_feature_dir` when given (else the online target), and tau always runs the
real target. Heads: "jetspec" (causal block),
"dflash" (bidirectional block, same architecture), "eagle" (`eagle.py`). `prefix_fill` > 0
(block heads) gives that fraction of training blocks a true-token prefix (`prefix_fill.py`,
for path-conditioned drafting); held-out KL always uses plain blocks. Writes under out_dir:
  metrics.jsonl   {"step", "loss", "kl" [J], "acc" [J], "lr", "grad_norm", "time"} per log
                  window; eval rows add {"eval": {"loss", "kl", "acc", "tau"}}
  checkpoints/    the last `keep_ckpts` train states
  head/           the final head (`head_io.save_draft`; eagle: `eagle.save_eagle`)
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
from tqdm.auto import tqdm

from jetspec_jax.decode.sampling import Sampler
from jetspec_jax.decode.speculative import TreeSpec, spec_generate, working_slots
from jetspec_jax.draft.head import DraftConfig, draft_config_for, draft_specs
from jetspec_jax.io.heads import save_draft
from jetspec_jax.model.config import ModelConfig
from jetspec_jax.model.params import init_params
from jetspec_jax.train import eagle
from jetspec_jax.train.data import DatasetError, load_shards
from jetspec_jax.train.features import load_features
from jetspec_jax.train.loss import cached_teacher_outputs, head_loss, teacher_outputs
from jetspec_jax.train.state import restore_state, save_state, state_dirs

HEADS = ("jetspec", "dflash", "eagle")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    data_dir: str
    out_dir: str
    eval_dir: str | None = None
    feature_dir: str | None = None  # cached teacher (features.py) of data_dir: no target pass
    eval_feature_dir: str | None = None  # cached teacher of eval_dir (feature_dir mode only)
    head: str = "jetspec"  # one of HEADS
    head_layers: int = 5  # (eagle: always one layer)
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
    prefix_fill: float = 0.0  # probability that a block gets a true-token prefix (block heads)
    seed: int = 0
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
            raise ValueError(f"unknown head {self.head!r}; choose from {sorted(HEADS)}")
        for name in ("steps", "batch_size", "num_anchors", "log_every", "ckpt_every",
                     "keep_ckpts", "eval_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.eval_feature_dir and not (self.feature_dir and self.eval_dir):
            raise ValueError("eval_feature_dir needs feature_dir and eval_dir")
        if not 0.0 <= self.prefix_fill <= 1.0:
            raise ValueError(f"prefix_fill must be in [0, 1], got {self.prefix_fill}")
        if self.prefix_fill > 0 and self.head == "eagle":
            raise ValueError("prefix_fill needs a block head (jetspec or dflash); the eagle "
                             f"head drafts a chain, got prefix_fill={self.prefix_fill}")

    def draft_config(self, tcfg: ModelConfig) -> DraftConfig | eagle.EagleConfig:
        if self.head == "eagle":
            return eagle.eagle_config_for(tcfg, num_taps=self.num_taps, depth=self.block_size - 1)
        dcfg = draft_config_for(tcfg, num_layers=self.head_layers, block_size=self.block_size,
                                num_taps=self.num_taps, mask_token_id=self.mask_token_id,
                                causal=self.head == "jetspec")
        dcfg.check_target(tcfg)
        return dcfg


@dataclasses.dataclass
class TrainResult:
    dparams: dict
    dcfg: DraftConfig | eagle.EagleConfig
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


def make_optimizer(cfg: TrainConfig):
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, cfg.lr, min(cfg.warmup_steps, cfg.steps - 1), cfg.steps, end_value=0.1 * cfg.lr)
    decay_mask = lambda params: jax.tree.map(lambda x: x.ndim >= 2, params)  # noqa: E731
    tx = optax.chain(optax.clip_by_global_norm(cfg.clip_norm),
                     optax.adamw(schedule, weight_decay=cfg.weight_decay, mask=decay_mask))
    return tx, schedule


def make_steps(cfg: TrainConfig, tcfg: ModelConfig, dcfg: DraftConfig | eagle.EagleConfig, tx,
               cached: bool = False):
    """Jitted (train_step, eval_step); only dparams is differentiated. cached: batches carry
    cached taps and top-K teacher (`features.load_features`) and the target is not run."""
    teacher = cached_teacher_outputs if cached else teacher_outputs

    def loss_and_metrics(dparams, tparams, batch, key, prefix_fill=0.0):
        teach = teacher(tparams, tcfg, dcfg, batch, key, cfg.num_anchors)
        return head_loss(dparams, dcfg, tparams, tcfg, batch["tokens"], teach, cfg.gamma,
                         key=jax.random.fold_in(key, 1), prefix_fill=prefix_fill)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(dparams, opt_state, tparams, batch, key):
        (loss, m), grads = jax.value_and_grad(loss_and_metrics, has_aux=True)(
            dparams, tparams, batch, key, cfg.prefix_fill)
        updates, opt_state = tx.update(grads, opt_state, dparams)
        return (optax.apply_updates(dparams, updates), opt_state,
                {"loss": loss, "grad_norm": optax.tree.norm(grads), **m})

    @jax.jit
    def eval_step(dparams, tparams, batch, key):
        loss, m = loss_and_metrics(dparams, tparams, batch, key)
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


def evaluate(cfg: TrainConfig, tcfg, dcfg, eval_step, dparams, tparams, data) -> dict:
    """Held-out KL / accuracy on fixed batches and anchors, and greedy SD's tau."""
    n = len(data["lengths"])
    rows = []
    for i in range(cfg.eval_batches):
        idx = np.arange(i * cfg.batch_size, (i + 1) * cfg.batch_size) % n
        batch = {k: jnp.asarray(v[idx]) for k, v in data.items()}
        rows.append(eval_step(dparams, tparams, batch, jax.random.key(i)))
    out = _mean_metrics(rows)
    if cfg.tau_prompts:
        out["tau"] = mean_accepted_length(cfg, tcfg, dcfg, dparams, tparams, data)
    return out


def mean_accepted_length(cfg: TrainConfig, tcfg, dcfg, dparams, tparams, data) -> float:
    """Tokens committed per round by greedy speculative decoding of held-out prompts."""
    idx = np.arange(cfg.tau_prompts) % len(data["lengths"])
    plens = data["prompt_lengths"][idx]
    prompt, plens = jnp.asarray(data["tokens"][idx, :plens.max()]), jnp.asarray(plens)
    slots = int(plens.max()) + cfg.tau_max_new + working_slots(cfg.tree_budget, cfg.block_size)
    kw = dict(max_new=cfg.tau_max_new, sampler=Sampler(), stop_ids=tuple(tcfg.eos_token_ids),
              num_slots=slots)
    if cfg.head == "eagle":
        _, stats = eagle.eagle_generate(tparams, dparams, prompt, plens, jax.random.key(0),
                                        tcfg=tcfg, ecfg=dcfg, budget=cfg.tree_budget,
                                        width=cfg.tree_width, **kw)
    else:
        _, stats = spec_generate(tparams, dparams, prompt, plens, jax.random.key(0), tcfg=tcfg,
                                 dcfg=dcfg, tree_spec=TreeSpec(cfg.tree_budget, cfg.tree_width),
                                 **kw)
    return float(np.sum(stats.accepted) / max(int(np.sum(stats.rounds)), 1))


def train(cfg: TrainConfig, tparams, tcfg: ModelConfig, *, stop_after: int | None = None,
          time_limit: float | None = None, progress: bool = True) -> TrainResult:
    """Trains (or resumes training of) a head; `stop_after` ends the run early at that step,
    as an interruption would (tests and time-sliced jobs). `time_limit` (seconds of this call)
    ends it at the first step past the limit: a checkpoint is saved (a rerun resumes there)
    and the head so far is written, marked incomplete in its metadata."""
    out = Path(cfg.out_dir)
    dcfg = cfg.draft_config(tcfg)
    specs = eagle.eagle_specs(dcfg) if cfg.head == "eagle" else draft_specs(dcfg)
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
    tx, schedule = make_optimizer(cfg)
    dparams = init_params(specs, jax.random.key(cfg.seed))
    opt_state = tx.init(dparams)
    sampler = BatchSampler(len(data["lengths"]), cfg.batch_size, cfg.seed)
    step, elapsed = 0, 0.0
    ckpts = state_dirs(out / "checkpoints")
    if ckpts:
        state, meta = restore_state(ckpts[-1], {"params": dparams, "opt_state": opt_state})
        if meta["draft_config"] != json.loads(json.dumps(dcfg.to_dict())):
            raise ValueError(f"{ckpts[-1]} holds a head {meta['draft_config']}, not the one "
                             f"this config makes: use another out_dir")
        dparams, opt_state = state["params"], state["opt_state"]
        step, elapsed = meta["step"], meta["elapsed"]
        sampler.restore(meta["data_sampler"])
    log = MetricLog(out / "metrics.jsonl", keep_until=step)
    train_step, eval_step = make_steps(cfg, tcfg, dcfg, tx, cached=bool(cfg.feature_dir))
    if cfg.feature_dir and not cfg.eval_feature_dir:
        _, eval_step = make_steps(cfg, tcfg, dcfg, tx, cached=False)  # online held-out KL
    base_key = jax.random.key(cfg.seed + 1)
    start, window = time.time() - elapsed, []
    bar = tqdm(total=cfg.steps, initial=step, desc="train head", disable=not progress)
    deadline, out_of_time = (time.time() + time_limit if time_limit else None), False
    while step < cfg.steps and not out_of_time and (stop_after is None or step < stop_after):
        batch = {k: jnp.asarray(v[sampler.next()]) for k, v in data.items()}
        dparams, opt_state, m = train_step(dparams, opt_state, tparams, batch,
                                           jax.random.fold_in(base_key, step))
        step += 1
        window.append(m)
        bar.update()
        row = {}
        if step % cfg.log_every == 0 or step == cfg.steps:
            row = {**_mean_metrics(window), "lr": float(schedule(step - 1))}
            window = []
            bar.set_postfix(loss=f"{row['loss']:.3f}", acc1=f"{row['acc'][0]:.2f}")
        if eval_data is not None and (step % cfg.eval_every == 0 or step == cfg.steps):
            row["eval"] = evaluate(cfg, tcfg, dcfg, eval_step, dparams, tparams, eval_data)
        if row:
            log.write({"step": step, **row, "time": time.time() - start})
        out_of_time = bool(deadline) and time.time() > deadline
        if step % cfg.ckpt_every == 0 or step == cfg.steps or out_of_time:
            save_state(out / "checkpoints", step, {"params": dparams, "opt_state": opt_state},
                       dataclasses.asdict(cfg), {"data_sampler": sampler.state(),
                                                 "elapsed": time.time() - start,
                                                 "draft_config": dcfg.to_dict()},
                       cfg.keep_ckpts)
    bar.close()
    timed_out = out_of_time and step < cfg.steps
    if step == cfg.steps or timed_out:
        save = eagle.save_eagle if cfg.head == "eagle" else save_draft
        save(out / "head", dparams, dcfg, overwrite=True,
             metadata={"steps": step, "complete": not timed_out,
                       "train_config": dataclasses.asdict(cfg)})
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

"""The Python API behind the CLI and the notebooks: load a target and a draft head
(`io/load.py`, re-exported here), generate (speculative, or autoregressive without a head)
with timings and acceptance statistics (`results.GenerationResult`), stream the same tokens
as they are committed (`stream`), and sweep tree budgets against autoregressive decoding.

    target = load_target("smollm2-135m")
    draft = load_draft(default_draft_path(target.name), target)
    result = generate(target, "Why is the sky blue?", draft=draft, compare_autoregressive=True)
    print(result.texts[0], result.tau_mean, result.speedup)

Prompts are right-padded into one batch; the prompt width and the cache slots are rounded up
to buckets and compiled executables are kept per shape, so repeated calls do not recompile and
`compile_s` is reported apart from the timed run.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jetspec_jax import costs
from jetspec_jax.decode import streaming
from jetspec_jax.decode.autoregressive import PREFILL_CHUNK, ar_generate, check_capacity
from jetspec_jax.decode.loop import Loop
from jetspec_jax.draft.head import draft_specs
from jetspec_jax.model import kernels as kernels_lib, layout, sharding
from jetspec_jax.model.blocks import BlockAllocator
from jetspec_jax.model.cache import Paging
from jetspec_jax.io.load import (  # noqa: F401  (re-exported: the API's loading half)
    CHECKPOINT_DIRS, DEFAULT_MODEL, DTYPES, Draft, Target, check_fits, default_draft_path,
    load_draft, load_target, ngram_draft, read_prompt_file, resolve_dtype)
from jetspec_jax.decode.sampling import Sampler
from jetspec_jax.decode.speculative import TreeSpec, spec_generate, working_slots
from jetspec_jax.decode.streaming import StreamChunk
from jetspec_jax.io.tokenizer import TokenizerError
from jetspec_jax.model.params import target_specs
from jetspec_jax.options import CPU_BUCKETS, GPU_BUCKETS  # jax-free: the CLI help reads them
from jetspec_jax.results import GenerationResult, format_mix  # noqa: F401

AUTO_BUCKETS = None  # tree sizes budget="auto" picks from each round; None: `auto_buckets()`

__all__ = ["Target", "Draft", "GenerationResult", "load_target", "load_draft", "ngram_draft",
           "default_draft_path", "generate", "stream", "StreamChunk", "bench",
           "read_prompt_file"]


# ---- options ---------------------------------------------------------------------------------


def exact_float32(dtype) -> None:
    """For a float32 run, makes JAX's float32 matmuls exact float32 (what "greedy speculative
    == autoregressive" is promised for): GPUs would otherwise run them in TF32, whose rounding
    can flip near-tie argmaxes. Other dtypes are left alone."""
    if jnp.dtype(dtype) == jnp.float32:
        jax.config.update("jax_default_matmul_precision", "highest")


def resolve_kernels(target: Target, attn_impl: str = "auto", matmul_impl: str = "auto",
                    mesh=None) -> kernels_lib.Kernels:
    """The kernels `generate` runs for this target on this machine and mesh."""
    return kernels_lib.choose(attn_impl, matmul_impl, moe=target.cfg.is_moe,
                              sharded=mesh is not None and mesh.size > 1)


def auto_buckets() -> tuple[int, ...]:
    """The tree sizes of budget="auto": AUTO_BUCKETS when set, else 16..256 on a GPU and
    4..32 on a CPU, where verifying costs nearly linearly in nodes."""
    if AUTO_BUCKETS is not None:
        return tuple(AUTO_BUCKETS)
    return GPU_BUCKETS if jax.default_backend() == "gpu" else CPU_BUCKETS


def default_tree(draft: Draft | None = None) -> dict[str, int]:
    """The tree this head was measured fastest with at batch 1 on this kind of machine
    (`Draft.best_tree`, from its model card's evaluation: "h200" stands for any GPU), filled
    in with the machine's defaults: budget 64 on a GPU, which verifies 64 nodes for little more
    than the cost of 16 (docs/benchmarks.md, "Speculative rounds"), and 4 on a CPU, where a
    verified node costs nearly an AR step's share; width 7; no n-gram chain."""
    gpu = jax.default_backend() == "gpu"
    measured = (draft.best_tree if draft is not None else {}).get("h200" if gpu else "cpu", {})
    return {"budget": 64 if gpu else 4, "width": 7, "ngram": 0} | measured


def default_budget(draft: Draft | None = None) -> int:
    """Tree nodes per round by default (`default_tree`)."""
    return default_tree(draft)["budget"]


@dataclasses.dataclass(frozen=True)
class Options:
    sampler: Sampler
    tree_spec: TreeSpec  # auto: budget max(auto_buckets()); buckets come with measured costs
    attn_impl: str  # checked against this machine; `kernels.choose` resolves it per model
    matmul_impl: str
    auto: bool = False  # budget="auto"


def decoding_options(*, budget=None, width=None, tree="accum_logp", temperature=0.0, top_k=0,
                     top_p=1.0, attn_impl="auto", matmul_impl="auto", ngram: int | None = None,
                     draft: Draft | None = None) -> Options:
    """Validates the decoding flags (cheap: the CLI calls it before loading a model).
    ngram: context chains of up to this many tokens in each tree (`TreeSpec.ngram`); budget,
    width, ngram None: `default_tree(draft)`'s (an explicit budget="auto" takes no chain)."""
    auto = isinstance(budget, str) and budget == "auto"
    defaults = default_tree(draft)
    width = defaults["width"] if width is None else width
    ngram = (0 if auto else defaults["ngram"]) if ngram is None else ngram
    if isinstance(budget, str) and not auto:
        raise ValueError(f"budget must be a number of tree nodes or 'auto', got {budget!r}")
    if auto and (ngram or draft is not None and getattr(draft.dcfg, "chain_only", False)):
        raise ValueError("n-gram chains take a fixed budget, not 'auto'")
    if budget is None:
        budget = defaults["budget"]
    spec = TreeSpec(max(auto_buckets()) if auto else budget, width, tree, ngram=ngram)
    kernels_lib.choose(attn_impl, matmul_impl)  # names and the machine checked up front
    return Options(Sampler(temperature, top_k, top_p), spec, attn_impl, matmul_impl, auto)


# ---- the target's mesh ------------------------------------------------------------------------


def on_mesh(target: Target):
    """The context to trace decoding programs in: the target's mesh (`sharding.use`), which
    the loops read to keep their caches sharded; a no-op on one device."""
    return sharding.use(target.mesh)


def zeros_on_mesh(make, target: Target):
    """make() (zeros: a decoding state, a cache) laid out as the decoding loops keep it on the
    target's mesh (`sharding.state_shardings`), made there in shards, never whole on one
    device; make() itself on one device."""
    if target.mesh is None:
        return make()
    out = sharding.state_shardings(jax.eval_shape(make), target.mesh)
    return jax.jit(make, out_shardings=out)()


# ---- prompts -> one padded batch -------------------------------------------------------------


def bucket(n: int, step: int = 64) -> int:
    """n rounded up to a power of two up to step, to a multiple of step past it: few distinct
    shapes, so calls with similar lengths share compiled code."""
    return 1 << (n - 1).bit_length() if n <= step else -(-n // step) * step


def encode_prompts(target: Target, prompts, *, chat: bool = True,
                   enable_thinking: bool | None = None) -> list[list[int]]:
    """str | list[str] | list[list[int]] (or one list[int]) -> token ids per prompt.
    enable_thinking: the chat template's switch of that name (Qwen3's: think before the
    answer), None: the template's default."""
    if isinstance(prompts, str) or (
            prompts and all(isinstance(t, (int, np.integer)) for t in prompts)):
        prompts = [prompts]
    if not prompts:
        raise ValueError("no prompts given")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if not p.strip():
                raise ValueError(f"prompt {i} is empty")
            out.append(_encode_text(target, p, chat, enable_thinking))
            continue
        ids = [int(t) for t in p]
        if not ids:
            raise ValueError(f"prompt {i} is empty")
        if bad := [t for t in ids if not 0 <= t < target.cfg.vocab_size]:
            raise ValueError(f"prompt {i} has token ids {bad[:5]} outside the vocab of "
                             f"{target.cfg.vocab_size}")
        out.append(ids)
    return out


def _encode_text(target: Target, text: str, chat: bool, enable_thinking: bool | None
                 ) -> list[int]:
    tok = target.tokenizer
    if tok is None:
        raise TokenizerError(f"{target.source} has no tokenizer (no tokenizer.json); pass "
                             "prompts as token ids")
    if not chat:
        return tok.encode(text)
    if not tok.chat_template:
        raise TokenizerError(f"the tokenizer of {target.source} has no chat template; pass "
                             "chat=False (--no-chat)")
    switch = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    return tok.apply_chat_template([{"role": "user", "content": text}],
                                   add_generation_prompt=True, **switch)


@dataclasses.dataclass(frozen=True)
class Batch:
    prompt: jax.Array  # [B, P] right-padded, P a bucket
    lens: jax.Array  # [B]
    num_slots: int  # S, a bucket


def make_batch(target: Target, ids: list[list[int]], max_new: int, extra: int) -> Batch:
    """Checks every prompt against the context limit and lays the batch out in buckets.

    extra: working slots past prompt + max_new (`check_capacity`'s `extra`)."""
    limit = target.cfg.max_position_embeddings
    if max_new < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new}")
    for i, p in enumerate(ids):
        if len(p) + max_new > limit:
            raise ValueError(
                f"prompt {i} has {len(p)} tokens; with max_new_tokens={max_new} it exceeds the "
                f"model's context limit of {limit} tokens (at most {limit - max_new} prompt "
                "tokens fit)")
    longest = max(map(len, ids))
    width = max(longest, min(bucket(longest), limit - max_new))  # padding must fit the limit
    num_slots = bucket(check_capacity(width, max_new, extra, limit, None), 128)
    pad = target.tokenizer.pad_id if target.tokenizer is not None else 0
    prompt = np.full((len(ids), width), pad, np.int32)
    for b, p in enumerate(ids):
        prompt[b, :len(p)] = p
    return Batch(jnp.asarray(prompt), jnp.asarray([len(p) for p in ids], jnp.int32),
                 num_slots)


def paged_layout(ids: list[list[int]], max_new: int, extra: int, num_slots: int,
                 block_size: int) -> tuple[Paging, np.ndarray, int]:
    """A paged cache for the batch: each row gets the blocks of its own prompt + max_new +
    extra slots from one pool (a bucket of blocks, so similar batches share compiled code).
    -> (paging, block table, slots per row: num_slots rounded up to whole blocks)."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"kv_block_size must be a whole number >= 1, got {block_size!r}")
    need = [len(p) + max_new + extra for p in ids]
    paging = Paging(block_size, bucket(1 + sum(-(-n // block_size) for n in need)))
    alloc = BlockAllocator(paging)
    for b, n in enumerate(need):
        alloc.grow(b, n)
    num_slots = -(-num_slots // block_size) * block_size
    return paging, alloc.table(range(len(ids)), num_slots), num_slots


# ---- timed runs ------------------------------------------------------------------------------

_COMPILED: dict = {}  # (function, argument shapes + shardings, static arguments) -> executable


def _compiled(fn, args: tuple, static: dict):
    """-> (the executable of jitted fn for args (arrays or shapes) and static, whether it was
    compiled now rather than found in `_COMPILED`)."""
    key = (fn, jax.tree.structure(args), tuple((x.shape, x.dtype, getattr(x, "sharding", None))
                                               for x in jax.tree.leaves(args)),
           tuple(sorted(static.items())))
    new = key not in _COMPILED
    if new:
        _COMPILED[key] = fn.lower(*args, **static).compile()
    return _COMPILED[key], new


def _timed(fn, args: tuple, static: dict):
    """-> (fn(*args, **static), seconds to compile and warm up (0 when cached), run seconds)."""
    start = time.perf_counter()
    run, new = _compiled(fn, args, static)
    compile_s = 0.0
    if new:
        jax.block_until_ready(run(*args))  # the first run pays one-time costs
        compile_s = time.perf_counter() - start
    start = time.perf_counter()
    out = jax.block_until_ready(run(*args))
    return out, compile_s, time.perf_counter() - start


_COSTS: dict = {}  # (configs, dtypes, batch shape, tree options, attention, mesh) -> costs


def adaptive_spec(target: Target, draft: Draft, tparams, dparams, prompt, spec: TreeSpec,
                  kernels: kernels_lib.Kernels, mesh) -> tuple[TreeSpec, float]:
    """budget="auto": the adaptive TreeSpec over `auto_buckets()`. A round's cost per bucket is
    measured once per (target, head, batch shape, tree options) and kept, as compiled code is
    (`costs.measure_costs`: it depends on shapes, not weights). -> (spec, seconds spent
    measuring, 0 when cached)."""
    key = (target.cfg, target.dtype, draft.dcfg, dparams["fc"].dtype, prompt.shape,
           spec.width, spec.method, kernels, mesh, auto_buckets())
    seconds = 0.0
    if key not in _COSTS:
        start = time.perf_counter()
        with sharding.use(mesh):
            _COSTS[key] = costs.measure_costs(
                tparams, target.cfg, dparams, draft.dcfg, buckets=auto_buckets(),
                width=spec.width, method=spec.method, batch=prompt.shape[0],
                context_len=prompt.shape[1], kernels=kernels,
                cache_dtype=target.dtype)
        seconds = time.perf_counter() - start
    return costs.auto_tree_spec(_COSTS[key], width=spec.width, method=spec.method), seconds


# ---- the verbs -------------------------------------------------------------------------------


@dataclasses.dataclass
class _Run:
    """A checked batch ready to decode: what `generate` and `stream` share."""
    ids: list[list[int]]  # prompt token ids
    opts: Options
    spec: TreeSpec  # budget="auto": the adaptive spec
    measure_s: float  # seconds spent measuring round costs for budget="auto"
    args: tuple  # (prompt, prompt_lens, key, block table or None), placed on the mesh
    tparams: dict
    dparams: dict | None
    sampler: Sampler
    loop: Loop  # the static settings both decoding loops share
    mesh: object

    def call(self, fn, *args, **static):
        with sharding.use(self.mesh):  # constraints in the decoding loops read the context mesh
            return fn(*args, **static)


def _prepare(target: Target, prompts, draft: Draft | None, *, max_new_tokens: int = 128,
             budget: int | str | None = None, width: int | None = None,
             tree: str = "accum_logp", temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, seed: int = 0, chat: bool = True,
             stop_ids: Sequence[int] | None = None, attn_impl: str = "auto",
             matmul_impl: str = "auto", mesh=None, prefill_chunk: int = PREFILL_CHUNK,
             ngram: int | None = None, enable_thinking: bool | None = None,
             kv_block_size: int | None = None) -> _Run:
    """`generate`'s options checked, the prompts encoded and batched, and the weights and
    batch placed on the mesh."""
    opts = decoding_options(budget=budget, width=width, tree=tree, temperature=temperature,
                            top_k=top_k, top_p=top_p, attn_impl=attn_impl,
                            matmul_impl=matmul_impl, ngram=ngram, draft=draft)
    if draft is not None:
        check_fits(draft, target)
    ids = encode_prompts(target, prompts, chat=chat, enable_thinking=enable_thinking)
    if stop_ids is None:
        stop_ids = (target.tokenizer and target.tokenizer.eos_token_ids) or target.cfg.eos_token_ids
    spec = opts.tree_spec
    extra = 1 if draft is None else working_slots(spec.budget, draft.dcfg.block_size)
    batch = make_batch(target, ids, max_new_tokens, extra)
    paging, table, num_slots = None, None, batch.num_slots
    if kv_block_size is not None:
        paging, table, num_slots = paged_layout(ids, max_new_tokens, extra, num_slots,
                                                kv_block_size)
    mesh = target.mesh if mesh is None else sharding.as_mesh(mesh)
    tparams, dparams = target.params, draft and draft.params
    prompt, lens, key = batch.prompt, batch.lens, jax.random.key(seed)
    if mesh is not None:  # weights already placed by load_target / load_draft are not moved
        if layout.is_fused(tparams):  # sharding knows the separate layout only
            tparams = layout.split_projections(tparams, target.cfg)
        tparams = sharding.shard_params(tparams, target_specs(target.cfg), mesh)
        if dparams:  # the n-gram drafter has no weights
            dparams = sharding.shard_params(dparams, draft_specs(draft.dcfg), mesh)
        prompt, lens, key, table = sharding.replicate((prompt, lens, key, table), mesh)
    kernels = resolve_kernels(target, opts.attn_impl, opts.matmul_impl, mesh)
    loop = Loop(max_new=max_new_tokens, num_slots=num_slots, stop_ids=tuple(stop_ids),
                kernels=kernels, cache_dtype=jnp.dtype(target.dtype),
                prefill_chunk=prefill_chunk, paging=paging)
    measure_s = 0.0
    if draft is not None and opts.auto:
        spec, measure_s = adaptive_spec(target, draft, tparams, dparams, prompt, spec, kernels,
                                        mesh)
    return _Run(ids, opts, spec, measure_s, (prompt, lens, key, table), tparams, dparams,
                opts.sampler, loop, mesh)


def generate(target: Target, prompts: str | Sequence[str] | Sequence[Sequence[int]], *,
             draft: Draft | None = None, max_new_tokens: int = 128,
             budget: int | str | None = None, width: int | None = None,
             tree: str = "accum_logp", temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, seed: int = 0, chat: bool = True,
             stop_ids: Sequence[int] | None = None, attn_impl: str = "auto",
             matmul_impl: str = "auto", compare_autoregressive: bool = False, mesh=None,
             prefill_chunk: int = PREFILL_CHUNK, ngram: int | None = None,
             enable_thinking: bool | None = None,
             kv_block_size: int | None = None) -> GenerationResult:
    """Speculative decoding with `draft` (autoregressive without one) of a batch of prompts.

    budget: tree nodes per round (None: `default_budget(draft)`), or "auto": each round picks its
    tree size from `auto_buckets()` by expected tokens per second (`adaptive_spec`); width:
    draft candidates per tree node (None: `default_tree(draft)`'s); chat: wrap text prompts in
    the chat template; enable_thinking: that template's switch of the name (Qwen3's; None: the
    template's default); stop_ids: None means the tokenizer's eos ids; attn_impl, matmul_impl:
    kernel names (`jetspec_jax.model.kernels`; "auto": the fastest measured for the model on
    this machine); compare_autoregressive: also time
    autoregressive decoding of the same batch (with a draft only); mesh: where to decode
    (None: the target's mesh, or one device), a spec such as "tp=2" or a `Mesh`;
    prefill_chunk: prompt tokens per prefill pass (smaller: less memory for long prompts in
    big batches; `decode.prefill` refuses a bad one while tracing, before
    anything compiles); ngram: add to each round's tree a chain of up to this many tokens
    that followed the latest earlier occurrence of the text's last 1-4 tokens in the prompt
    and the output (0: none; None: `default_tree(draft)`'s; `draft/ngram.py`).
    draft=`ngram_draft(L)` drafts such chains alone, with no head. kv_block_size: page the
    target's KV cache in blocks of this many slots, each prompt holding the blocks of its own
    length only (None: dense rows, each as long as the longest; a multiple of 16 lets the GPU
    kernels read the blocks in place)."""
    run = _prepare(target, prompts, draft, max_new_tokens=max_new_tokens, budget=budget,
                   width=width, tree=tree, temperature=temperature,
                   top_k=top_k, top_p=top_p, seed=seed, chat=chat, stop_ids=stop_ids,
                   attn_impl=attn_impl, matmul_impl=matmul_impl, mesh=mesh,
                   prefill_chunk=prefill_chunk, ngram=ngram, enable_thinking=enable_thinking,
                   kv_block_size=kv_block_size)

    def autoregressive():
        return run.call(_timed, ar_generate, (run.tparams, *run.args),
                        dict(cfg=target.cfg, sampler=run.sampler, loop=run.loop))

    common = dict(prompt_lens=list(map(len, run.ids)),
                  attn_impl=run.loop.kernels.attention_name,
                  greedy=run.opts.sampler.greedy)
    if draft is None:
        out, compile_s, seconds = autoregressive()
        return GenerationResult(*_decoded(target, out), seconds=seconds, compile_s=compile_s,
                                **common)
    (out, stats), compile_s, seconds = run.call(
        _timed, spec_generate, (run.tparams, run.dparams, *run.args),
        dict(tcfg=target.cfg, dcfg=draft.dcfg, tree_spec=run.spec, sampler=run.sampler,
             loop=run.loop))
    rounds = np.asarray(stats.rounds).tolist()
    per_round = lambda x: [row[:r].tolist() for row, r in zip(np.asarray(x), rounds)]  # noqa: E731
    result = GenerationResult(*_decoded(target, out), seconds=seconds,
                              compile_s=compile_s + run.measure_s,
                              draft=draft.path or "<in memory>", tree_spec=run.spec,
                              rounds=rounds, accepted=per_round(stats.accepted),
                              nodes=per_round(stats.nodes), **common)
    if compare_autoregressive:
        ar, result.ar_compile_s, result.ar_seconds = autoregressive()
        result.ar_tokens = _decoded(target, ar)[1]
    return result


def stream(target: Target, prompts: str | Sequence[str] | Sequence[Sequence[int]], *,
           draft: Draft | None = None, chunk: int | None = None,
           **options) -> Iterator[StreamChunk]:
    """`generate`'s decoding (its options but compare_autoregressive; the same tokens),
    yielding them as they are committed: a `StreamChunk` of new token ids and text per
    sequence after the prefill, then after every `chunk` rounds (speculative; default
    `streaming.SPEC_CHUNK` = 4) or decoding steps (autoregressive; `AR_CHUNK` = 8). Each
    chunk is one compiled call and one read-back to the host. Options are checked, and both
    programs compiled (or found compiled), before this returns."""
    run = _prepare(target, prompts, draft, **options)
    if draft is None:
        steps = streaming.ar_steps(target.cfg, run.sampler, run.loop, chunk)
    else:
        steps = streaming.spec_steps(target.cfg, draft.dcfg, run.spec, run.sampler, run.loop,
                                     chunk)
    params = (run.tparams,) if draft is None else (run.tparams, run.dparams)
    start, _ = run.call(_compiled, steps.start, (*params, *run.args), steps.start_static)
    advance, _ = run.call(_compiled, steps.advance, (*params, start.out_info),
                          steps.advance_static)
    return streaming.chunks(lambda: start(*params, *run.args),
                            lambda state: advance(*params, state), target.tokenizer)


def _decoded(target: Target, out) -> tuple[list[str], list[list[int]]]:
    """-> (texts, token ids) of each sequence (texts empty without a tokenizer)."""
    tokens, counts = np.asarray(out.tokens), np.asarray(out.num_tokens)
    ids = [tokens[b, :n].tolist() for b, n in enumerate(counts)]
    tok = target.tokenizer
    return [tok.decode(t, skip_special_tokens=True) if tok else "" for t in ids], ids


def bench(target: Target, prompts, *, draft: Draft,
          budgets: Sequence[int | str] = (4, 8, 16, 32, 64), max_new_tokens: int = 128,
          width: int | None = None, tree: str = "accum_logp", chat: bool = True,
          attn_impl: str = "auto", progress: bool = True,
          ngram: int | None = None) -> list[dict]:
    """Greedy speculative vs autoregressive decoding of the same batch, for each budget (a
    number of tree nodes or "auto"; each pair timed back to back) -> one row per budget, with
    the rounds per tree size (`bucket_mix`); ngram: as for `generate`."""
    for b in budgets:  # every budget checked before anything runs
        decoding_options(budget=b, width=width, tree=tree, attn_impl=attn_impl, ngram=ngram,
                         draft=draft)
    rows = []
    for b in tqdm(budgets, desc="bench", unit="budget", disable=not progress):
        r = generate(target, prompts, draft=draft, max_new_tokens=max_new_tokens, budget=b,
                     width=width, tree=tree, chat=chat, ngram=ngram,
                     attn_impl=attn_impl, compare_autoregressive=True)
        rows.append(dict(budget=b, tau=r.tau_mean, tau_hist=r.tau_hist, tokens=r.num_generated,
                         seconds=r.seconds, tokens_per_s=r.tokens_per_s,
                         ar_seconds=r.ar_seconds, ar_tokens_per_s=r.ar_tokens_per_s,
                         speedup=r.speedup, identical=r.ar_identical,
                         bucket_mix=r.bucket_mix, compile_s=r.compile_s + r.ar_compile_s))
    return rows

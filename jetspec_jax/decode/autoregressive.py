"""Prefill and autoregressive decoding: the whole loop on device in one `lax.while_loop`
(`ar_generate`), or in chunks of steps that a host loop streams (`ar_start`, `ar_continue`)."""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp

from jetspec_jax.decode.loop import Loop
from jetspec_jax.decode.sampling import RowSampler, Sampler, choose_tokens, split_key
from jetspec_jax.model import target
from jetspec_jax.model.cache import KVCache
from jetspec_jax.model.config import ModelConfig
from jetspec_jax.model.kernels import Kernels
from jetspec_jax.model.sharding import constrain_state


# Default prompt tokens per prefill pass. One pass over the whole prompt holds [B, H, P, S]
# attention scores: the AR program of 311 MATH500 prompts (832 tokens) in SmolLM2 needed 34.1 GiB
# of temporaries on the CPU, 20.8 in chunks of 256 (docs/experiments.md).
from jetspec_jax.options import PREFILL_CHUNK  # jax-free: the CLI reads it


def prefill(params, cfg: ModelConfig, prompt, prompt_lens, cache: KVCache, *,
            taps=(), kernels: Kernels = Kernels(), chunk: int = PREFILL_CHUNK):
    """prompt [B, P] right-padded, prompt_lens [B]. Returns (logits at each prompt's last token
    [B, V], cache holding the prompts, taps [B, P, k*D] or None).

    The prompt goes through the target `chunk` tokens at a time, each chunk seeing the slots of
    the ones before it: the same attention, less memory."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"prefill_chunk must be a whole number >= 1, got {chunk!r}")
    cache, last, tapped = _prefill_forward(params, cfg, prompt, prompt_lens, cache, taps,
                                           kernels, chunk)
    return (*prefill_logits(params, cfg, last, prompt_lens, cache, kernels), tapped)


def prefill_pass(params, cfg: ModelConfig, tokens, start, prompt_lens, cache: KVCache, last,
                 *, taps=(), kernels: Kernels = Kernels()):
    """One pass of a chunked prefill: tokens [B, C] at positions start.. (after the slots of
    the passes before). last [B, 1, D]: the final hidden state at each prompt's last token,
    replaced where that token is in this pass. -> (cache, last, taps [B, C, k*D] or None)."""
    b, c = tokens.shape
    positions = start + jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32), tokens.shape)
    hidden, cache, tapped = target.forward(params, cfg, tokens, positions, cache,
                                           jnp.full((b,), start, jnp.int32), None, taps=taps,
                                           kernels=kernels)
    at = prompt_lens - 1 - start
    here = jnp.take_along_axis(hidden, jnp.clip(at, 0, c - 1)[:, None, None], axis=1)
    last = jnp.where(((at >= 0) & (at < c))[:, None, None], here, last)
    return cache, last, tapped


def prefill_carry(params, cfg: ModelConfig, batch: int, loop: Loop):
    """What a prefill of `batch` prompts starts from, pass by pass (`prefill_pass`): an empty
    cache of `loop.num_slots` slots and `last`."""
    return (target.allocate_cache(cfg, batch, loop.num_slots, loop.cache_dtype),
            _no_last(params, cfg, batch))


def _no_last(params, cfg: ModelConfig, batch: int):
    return jnp.zeros((batch, 1, cfg.hidden_size), params["embed"].dtype)


def prefill_logits(params, cfg: ModelConfig, last, prompt_lens, cache: KVCache,
                   kernels: Kernels = Kernels()):
    """The end of a prefill: (logits [B, V] from `last` [B, 1, D], the cache holding the
    prompts)."""
    logits = target.lm_head(params, cfg, last, kernels)[:, 0]
    return logits, constrain_state(cache.replace(lengths=prompt_lens.astype(jnp.int32)))


def _prefill_forward(params, cfg, prompt, prompt_lens, cache, taps, kernels, chunk):
    """(cache, last hidden [B, 1, D], taps or None). Past one chunk, the whole chunks run in a
    `lax.scan` (one compiled copy of the model however long the prompt), then the remainder."""
    b, p = prompt.shape
    last = _no_last(params, cfg, b)
    run = functools.partial(prefill_pass, params, cfg, prompt_lens=prompt_lens, taps=taps,
                            kernels=kernels)

    def body(carry, j):
        tokens = jax.lax.dynamic_slice_in_dim(prompt, j * chunk, chunk, axis=1)
        cache, last, tapped = run(tokens, j * chunk, cache=carry[0], last=carry[1])
        return (cache, last), tapped

    whole = p // chunk if p > chunk else 0
    parts = []  # taps per pass, in prompt order
    if whole:
        (cache, last), tapped = jax.lax.scan(body, (cache, last),
                                             jnp.arange(whole, dtype=jnp.int32))
        # [whole, B, chunk, F] -> [B, whole * chunk, F]
        parts.append(tapped if tapped is None else
                     jnp.swapaxes(tapped, 0, 1).reshape(b, -1, tapped.shape[-1]))
    if whole * chunk < p:
        cache, last, tapped = run(prompt[:, whole * chunk:], whole * chunk, cache=cache,
                                  last=last)
        parts.append(tapped)
    return cache, last, None if not taps else jnp.concatenate(parts, axis=1)


@flax.struct.dataclass
class Output:
    """Generated tokens and their count per sequence (the first `num_tokens[b]` are valid)."""

    tokens: jax.Array  # [B, M + slack]
    num_tokens: jax.Array  # [B]
    done: jax.Array  # [B]

    @classmethod
    def empty(cls, batch, width):
        return cls(tokens=jnp.zeros((batch, width), jnp.int32),
                   num_tokens=jnp.zeros((batch,), jnp.int32),
                   done=jnp.zeros((batch,), bool))

    def append(self, new_tokens, count, stop_ids: tuple[int, ...], max_new: int) -> "Output":
        """Appends new_tokens[b, :count[b]] to unfinished sequences, cutting after a stop token
        and at max_new tokens."""
        w = new_tokens.shape[1]
        in_count = jnp.arange(w)[None, :] < count[:, None]
        is_stop = jnp.isin(new_tokens, jnp.asarray(stop_ids or (-1,), jnp.int32)) & in_count
        first_stop = jnp.argmax(is_stop, axis=1)
        has_stop = jnp.any(is_stop, axis=1)
        count = jnp.where(has_stop, first_stop + 1, count)
        count = jnp.where(self.done, 0, jnp.minimum(count, max_new - self.num_tokens))
        tokens = jax.vmap(lambda row, new, start: jax.lax.dynamic_update_slice(row, new, (start,)))(
            self.tokens, jnp.where(self.done[:, None], self.tokens[:, :w], new_tokens),
            jnp.where(self.done, 0, self.num_tokens))
        num = self.num_tokens + count
        done = self.done | (has_stop & (count > 0)) | (num >= max_new)
        return Output(tokens=tokens, num_tokens=num, done=done)


def check_capacity(prompt_len: int, max_new: int, extra: int, limit: int, num_slots: int | None):
    """Clear error when a prompt plus its generation cannot fit the cache or the model."""
    need = prompt_len + max_new + extra
    if prompt_len < 1:
        raise ValueError("empty prompt: at least one token is needed")
    if max_new < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new}")
    if prompt_len + max_new > limit:
        raise ValueError(
            f"prompt of {prompt_len} tokens + {max_new} new tokens exceeds the model's context "
            f"limit of {limit} tokens")
    if num_slots is not None and need > num_slots:
        raise ValueError(
            f"prompt of {prompt_len} tokens + {max_new} new tokens (+{extra} working slots) does "
            f"not fit a KV cache of {num_slots} slots")
    return need


def loop_until_done(body, state, max_iters: int | None = None, extra: int = 1):
    """body applied while some sequence of state.out is unfinished, at most max_iters times
    (None: no limit). One `lax.while_loop`: the whole generation (or one streamed chunk of it)
    stays on device. Paged, it also stops before a step that an unfinished row's blocks cannot
    hold (`KVCache.has_room(extra)`): the host gives the row more and continues."""

    def go(s):
        more, room = ~jnp.all(s.out.done), s.cache.has_room(extra)
        return more if room is None else more & jnp.all(room | s.out.done)

    if max_iters is None:
        return jax.lax.while_loop(go, body, state)
    state, _ = jax.lax.while_loop(lambda c: go(c[0]) & (c[1] < max_iters),
                                  lambda c: (body(c[0]), c[1] + 1), (state, jnp.int32(0)))
    return state


@flax.struct.dataclass
class ARState:
    """Autoregressive decoding between steps: what a streamed generation carries across calls."""
    cache: KVCache
    out: Output
    last: jax.Array  # [B] the newest token, not yet in the cache
    key: jax.Array


def ar_start(params, prompt, prompt_lens, key, table=None, *, cfg: ModelConfig,
             sampler: Sampler, loop: Loop) -> ARState:
    """Checks that the batch fits, then `prefill_state`."""
    check_capacity(prompt.shape[1], loop.max_new, 1, cfg.max_position_embeddings,
                   loop.num_slots)
    return prefill_state(params, cfg, prompt, prompt_lens, key, sampler, loop, table=table)[0]


def prefill_state(params, cfg: ModelConfig, prompt, prompt_lens, key,
                  sampler: Sampler | RowSampler, loop: Loop, *, taps=(), slack: int = 1,
                  table=None):
    """Prefill and the first token, the start of both loops -> (ARState, the prompts' taps
    [B, P, k*D] or None). slack: output columns past max_new (a round may overshoot it);
    table: [B, num_slots / block_size] when loop.paging (`blocks.BlockAllocator.table`)."""
    cache = target.allocate_cache(cfg, prompt.shape[0], loop.num_slots, loop.cache_dtype,
                                  loop.paging, table)
    logits, cache, prompt_taps = prefill(params, cfg, prompt, prompt_lens, cache, taps=taps,
                                         kernels=loop.kernels, chunk=loop.prefill_chunk)
    return first_token(logits, cache, key, sampler, loop, slack=slack), prompt_taps


def first_token(logits, cache: KVCache, key, sampler: Sampler | RowSampler, loop: Loop, *,
                slack: int = 1) -> ARState:
    """The state after a prefill: the first token chosen from the prompts' last logits
    [B, V]."""
    b = logits.shape[0]
    key, sub = split_key(key)
    first = choose_tokens(sub, logits, sampler)
    out = Output.empty(b, loop.max_new + slack).append(
        first[:, None], jnp.ones((b,), jnp.int32), loop.stop_ids, loop.max_new)
    return ARState(cache=cache, out=out, last=first, key=key)


def ar_continue(params, state: ARState, *, cfg: ModelConfig, sampler: Sampler | RowSampler,
                loop: Loop, max_steps: int | None = None) -> ARState:
    """Decoding steps until every sequence is done, or max_steps of them."""
    ones = jnp.ones(state.last.shape, jnp.int32)

    def step(s: ARState) -> ARState:
        key, sub = split_key(s.key)
        nxt, cache = decode_step(params, cfg, s.cache, s.last, sub, sampler, s.out.done,
                                 loop.kernels)
        out = s.out.append(nxt[:, None], ones, loop.stop_ids, loop.max_new)
        return ARState(cache=cache, out=out, last=nxt, key=key)

    return loop_until_done(step, state, max_steps)


@functools.partial(jax.jit, static_argnames=("cfg", "sampler", "loop"))
def ar_generate(params, prompt, prompt_lens, key, table=None, *, cfg: ModelConfig,
                sampler: Sampler, loop: Loop) -> Output:
    """Autoregressive decoding of a right-padded batch; returns the generated tokens.
    table: the paged cache's block table (loop.paging), each row's blocks holding at least
    prompt + max_new + 1 slots."""
    state = ar_start(params, prompt, prompt_lens, key, table, cfg=cfg, sampler=sampler,
                     loop=loop)
    return ar_continue(params, state, cfg=cfg, sampler=sampler, loop=loop).out


def decode_step(params, cfg: ModelConfig, cache: KVCache, last, key, sampler: Sampler, done,
                kernels: Kernels = Kernels()):
    """One autoregressive step: feeds last [B] at position lengths, returns (next [B], cache).
    Finished sequences (done) keep their length."""
    pos = cache.lengths
    hidden, cache, _ = target.forward(params, cfg, last[:, None], pos[:, None], cache, pos,
                                      kernels=kernels)
    nxt = choose_tokens(key, target.lm_head(params, cfg, hidden, kernels)[:, 0], sampler)
    return nxt, constrain_state(cache.replace(lengths=jnp.where(done, pos, pos + 1)))

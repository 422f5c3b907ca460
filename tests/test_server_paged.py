"""The engine on paged KV caches (`EngineConfig.kv_block_size`): each request's greedy tokens
equal its own alone (speculative and autoregressive), a pool too small for every request at
once admits them as blocks free up, a pool of a few dense rows' memory runs more requests at
once than those rows could, cancelled requests give their blocks back, and bad settings fail
before anything compiles."""

import threading
import time

import jax
import numpy as np
import pytest

from helpers import tiny_models
from jetspec_jax import api
from jetspec_jax.cli import main
from jetspec_jax.serve.engine import Engine, EngineConfig, Request

BLOCK = 16
_rng = np.random.default_rng(3)
PROMPTS = [_rng.integers(0, 64, n).tolist() for n in (3, 9, 20, 30, 5, 14, 7, 11)]
LIMITS = [12, 30, 10, 25, 40, 20, 8, 16]
MAX_NEW = max(LIMITS)


class Watched(Engine):
    """Records the most requests in slots, blocks reserved and blocks held at its device
    calls, and the speculative rows a call ran fewer than `chunk` rounds for although they
    had not finished (rows whose blocks ran out)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.peak_slots = self.peak_reserved = self.peak_held = 0
        self.short_rows = 0

    def _run_round(self, active):
        before = [r.rounds for r in self.slots]
        state, view = super()._run_round(active)
        _, _, done, rounds, _ = jax.device_get(view)
        self.short_rows += sum(rounds[i] - b < self.chunk and not done[i]
                               for i, b in enumerate(before))
        return state, view

    def _grow(self):
        super()._grow()
        if self.pool is None:
            return
        self.peak_slots = max(self.peak_slots, len(self.slots))
        self.peak_reserved = max(self.peak_reserved, sum(self.reserved.values()))
        self.peak_held = max(self.peak_held, self.pool.paging.num_blocks - 1 - self.pool.num_free)


@pytest.fixture(scope="module")
def models():
    return tiny_models()


@pytest.fixture(scope="module")
def solo(models):
    """Each prompt's greedy tokens alone (`api.generate`; a greedy row does not depend on its
    neighbours), cut at a request's max_tokens."""
    tokens = api.generate(models[0], PROMPTS, max_new_tokens=MAX_NEW).tokens
    return lambda i, max_tokens: tokens[i][:max_tokens]


def engine(models, draft: bool, **config) -> Watched:
    config = dict(dict(slot_buckets=(config["max_batch"],), kv_block_size=BLOCK), **config)
    eng = Watched(models[0], models[1] if draft else None, EngineConfig(**config))
    eng.start()
    return eng


def run_all(eng, cases, requests=None) -> list[list[int]]:
    """Submits (prompt index, max_tokens) cases at once -> each one's tokens (requests: a
    list that gets the finished requests)."""
    runs = []
    with eng.wake:  # all queued before the engine thread looks
        for i, m in cases:
            tokens, ended = [], threading.Event()
            request = Request(PROMPTS[i], m, on_event(tokens, ended))
            eng.submit(request)
            runs.append((tokens, ended))
            if requests is not None:
                requests.append(request)
    for _, ended in runs:
        assert ended.wait(60)
    return [tokens for tokens, _ in runs]


def on_event(tokens, ended):
    def event(new, finish, error):
        assert error is None, error
        tokens.extend(new)
        if finish is not None:
            ended.set()
    return event


def blocks_used(eng, timeout=10.0) -> float:
    """The blocks-in-use gauge once it reads 0, or after timeout (it is set after each device
    call, just after the requests end, and after the other pool gauges)."""
    deadline = time.monotonic() + timeout
    while eng.metrics.get("kv_blocks_used") and time.monotonic() < deadline:
        time.sleep(0.01)
    return eng.metrics.get("kv_blocks_used")


def test_speculative_paged_requests_equal_their_solo_outputs_and_the_dense_rounds(
        models, solo):
    """Tokens as alone; the rounds and accepted drafts of each request as on dense rows (the
    head's context, paged too, is the same). Prompts are prefilled in passes of 8 tokens."""
    cases = list(enumerate(LIMITS[:6]))
    stats = []
    for block_size in (None, BLOCK):
        eng = engine(models, True, max_batch=4, max_len=64, budget=8, chunk=2,
                     prefill_chunk=8, kv_block_size=block_size)
        try:
            requests = []
            assert run_all(eng, cases, requests) == [solo(i, m) for i, m in cases]
            stats.append([(r.rounds, r.accepted) for r in requests])
        finally:
            eng.stop()
    assert stats[1] == stats[0]
    assert eng.peak_slots == 4 and blocks_used(eng) == 0
    assert eng.short_rows == 0  # each call's blocks held all its rounds
    # the default pool holds max_batch dense rows
    assert eng.pool.paging.num_blocks - 1 == 4 * eng.num_slots // BLOCK
    assert eng.metrics.get("kv_blocks_free") == eng.pool.paging.num_blocks - 1


def test_a_pool_for_two_requests_serves_six_as_blocks_free_up(models, solo):
    """Each request reserves the blocks of prompt + max_tokens + a call's steps (3 or 4 blocks
    of 16 slots here; 5 at max_len): a pool of 10 holds two or three such at once. Without the
    reservation rows would run out of blocks mid-generation and fail. Arrivals are prefilled
    into the pool a pass of 8 tokens at a time between the running rows' device calls."""
    eng = engine(models, False, max_batch=4, max_len=64, chunk=4, kv_blocks=10,
                 prefill_chunk=8)
    try:
        cases = [(3, 25), (1, 30), (2, 30), (5, 20), (0, 40), (4, 40)]
        assert run_all(eng, cases) == [solo(i, m) for i, m in cases]
        # never all four slots: the fourth request's blocks were never free beside three
        assert 2 <= eng.peak_slots <= 3 and 0 < eng.peak_held <= eng.peak_reserved <= 10
        assert blocks_used(eng) == 0 and eng.metrics.get("kv_blocks_free") == 10
        assert eng.metrics.get("kv_blocks_reserved") == 0
    finally:
        eng.stop()


@pytest.fixture(scope="module")
def wide(models):
    """max_len 256 (384 slots a row), a pool of two dense rows' memory, 8 slots."""
    eng = engine(models, False, max_batch=8, max_len=256, chunk=4, kv_blocks=2 * 384 // BLOCK)
    yield eng
    eng.stop()


def test_short_requests_outnumber_the_dense_rows_of_the_same_memory(wide, solo):
    assert wide.num_slots == 384  # two dense rows: 2 * 384 slots, the pool's 48 blocks
    cases = [(i, 8) for i in range(8)]
    assert run_all(wide, cases) == [solo(i, 8) for i in range(8)]
    assert wide.peak_slots == 8  # > 2: all at once, each holding 1-3 blocks
    assert blocks_used(wide) == 0


def test_a_cancelled_request_gives_its_blocks_back(wide):
    tokens, ended = [], threading.Event()
    request = Request(PROMPTS[3], 200, on_event(tokens, ended))
    wide.submit(request)
    deadline = time.monotonic() + 30
    while not tokens and time.monotonic() < deadline:
        time.sleep(0.01)
    assert tokens and wide.metrics.get("kv_blocks_used") > 0
    request.cancel()
    assert ended.wait(30) and len(tokens) < 200
    assert blocks_used(wide) == 0 and wide.pool.num_free == 48
    assert wide.metrics.get("kv_blocks_reserved") == 0


def test_a_prefill_that_cannot_start_fails_its_requests_alone(wide, solo):
    """Its requests end with an error and give their blocks back; the next ones run."""
    real, calls = wide._carry, []

    def fail_once(n, requests):
        calls.append(n)
        if len(calls) == 1:
            raise RuntimeError("out of device memory")
        return real(n, requests)

    wide._carry = fail_once
    try:
        errors, ended = [], threading.Event()
        wide.submit(Request(PROMPTS[1], 8, lambda toks, reason, error: (
            errors.append(error), ended.set()) if reason or error else None))
        assert ended.wait(30) and "prefill failed: out of device memory" in errors[-1]
        assert blocks_used(wide) == 0 and wide.metrics.get("kv_blocks_reserved") == 0
        assert run_all(wide, [(2, 8)]) == [solo(2, 8)]
    finally:
        wide._carry = real


@pytest.mark.parametrize("changes, words", [
    (dict(kv_block_size=24), "kv_block_size must be a multiple of 16"),
    (dict(kv_block_size=8), "kv_block_size must be a multiple of 16"),
    (dict(kv_blocks=8), "kv_blocks=8 needs kv_block_size"),
])
def test_bad_paging_settings_fail_in_the_config(changes, words):
    with pytest.raises(ValueError, match=words):
        EngineConfig(**changes)


def test_a_pool_smaller_than_one_request_fails_before_compiling(models):
    # max_len 64 + 4 steps ahead: 5 blocks of 16
    with pytest.raises(ValueError, match=r"kv_blocks \(--kv-blocks\) = 4 cannot hold one "
                                         r"request of max_len=64 .* needs 5 blocks"):
        Engine(models[0], None, EngineConfig(max_len=64, chunk=4, kv_block_size=16,
                                             kv_blocks=4))


@pytest.mark.parametrize("argv, words", [
    (["--kv-block-size", "24"], "--kv-block-size must be a multiple of 16"),
    (["--kv-blocks", "8"], "--kv-blocks sizes the pool of a paged cache: set --kv-block-size"),
    (["--kv-block-size", "16", "--kv-blocks", "10", "--max-len", "256"],
     "--kv-blocks 10 of 16 slots cannot hold one request of --max-len 256 tokens"),
])
def test_bad_serve_flags_fail_in_one_line_before_loading(capsys, argv, words):
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and words in err, err

"""The engine's prefill: arrivals admitted together are prefilled in one batch, a pass of at
most `prefill_chunk` tokens between device calls of rounds; each request's greedy tokens equal
its own alone, and running requests keep decoding while a long prompt is read."""

import threading

import numpy as np
import pytest

from helpers import tiny_models
from jetspec_jax import api
from jetspec_jax.serve.engine import Engine, EngineConfig, Request

CHUNK = 8
MAX_LEN = 64
_rng = np.random.default_rng(0)
# at once: 20 and 30 tokens take more than one pass; then a short one beside a long one
TOGETHER = [_rng.integers(0, 64, n).tolist() for n in (3, 9, 20, 30, 5)]
SHORT, LONG = _rng.integers(0, 64, 2).tolist(), _rng.integers(0, 64, 40).tolist()


class Recorder(Engine):
    """Records the order of its device calls: ("pass", the group's prompt lengths, prompt
    tokens read before it) and ("round", tokens each active request has so far)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.events = []
        self.after_pass = lambda prefill: None

    def _prefill_pass(self):
        p = self.prefill
        self.events.append(("pass", tuple(len(r.ids) for r in p.requests), p.done))
        super()._prefill_pass()
        self.after_pass(p)

    def _step(self):
        self.events.append(("round", tuple(r.sent for r in self.slots)))
        super()._step()


@pytest.fixture(scope="module")
def models():
    return tiny_models()


@pytest.fixture(scope="module")
def engine(models):
    """Speculative, one round per device call: a running request advances by a few tokens a
    call, so it is still running while a 40-token prompt is read in 5 passes."""
    eng = Recorder(*models, EngineConfig(max_batch=4, slot_buckets=(4,), max_len=MAX_LEN,
                                         budget=8, chunk=1, prefill_chunk=CHUNK))
    eng.start()
    yield eng
    eng.stop()


def submit(eng, ids, max_tokens) -> tuple[list[int], threading.Event]:
    """-> (the tokens as they arrive, set when the request ends)."""
    tokens, ended = [], threading.Event()

    def on_event(new, finish, error):
        assert error is None, error
        tokens.extend(new)
        if finish is not None:
            ended.set()

    eng.submit(Request(ids, max_tokens, on_event))
    return tokens, ended


@pytest.fixture(scope="module")
def reference(models):
    """Each prompt's greedy tokens from `api.generate` (the rows of a greedy batch do not
    depend on each other; one call, one compile): each cut at its max_tokens."""
    prompts = [*TOGETHER, SHORT, LONG]
    tokens = api.generate(models[0], prompts, max_new_tokens=MAX_LEN).tokens
    return lambda ids, max_tokens: tokens[prompts.index(ids)][:max_tokens]


def tokens_of(runs) -> list[list[int]]:
    for _, ended in runs:
        assert ended.wait(60)
    return [tokens for tokens, _ in runs]


def test_simultaneous_arrivals_of_different_lengths_each_equal_the_request_alone(
        engine, reference):
    limits = [12, 7, 10, 9, 6]
    engine.events.clear()
    with engine.wake:  # all queued before the engine thread looks
        runs = [submit(engine, p, m) for p, m in zip(TOGETHER, limits)]
    assert tokens_of(runs) == [reference(p, m) for p, m in zip(TOGETHER, limits)]
    passes = [e for e in engine.events if e[0] == "pass"]
    # the first four in one prefill: 30 tokens in passes of 8 (the last one padded);
    # the fifth waits for a free slot
    assert passes[:5] == [*(("pass", (3, 9, 20, 30), done) for done in (0, 8, 16, 24)),
                          ("pass", (5,), 0)]


def test_a_running_request_advances_between_the_passes_of_a_long_prompt(engine, reference):
    running, running_ended = submit(engine, SHORT, MAX_LEN - 3)
    while not running:  # it has started decoding
        assert not running_ended.wait(0.01)
    late, late_ended = submit(engine, LONG, 8)
    assert late_ended.wait(60) and running_ended.wait(60)
    calls = engine.events[engine.events.index(("pass", (40,), 0)):]
    passes = [i for i, e in enumerate(calls) if e[0] == "pass"]
    assert len(passes) == 5  # 40 tokens in passes of 8
    between = [calls[i + 1] for i in passes]  # the round each pass is followed by
    assert all(e[0] == "round" for e in between)
    sent = [e[1][0] for e in between]  # the running request's tokens before that round
    assert sent == sorted(set(sent)), sent
    assert running == reference(SHORT, MAX_LEN - 3) and late == reference(LONG, 8)


def test_a_prefill_whose_requests_are_all_cancelled_ends_at_the_next_boundary(engine):
    events, ended = [], threading.Event()

    def on_event(*event):
        events.append(event)
        ended.set()

    request = Request(LONG, 8, on_event)
    engine.events.clear()
    engine.after_pass = lambda prefill: request.cancel()  # after its first pass of five
    try:
        engine.submit(request)
        assert ended.wait(60)
    finally:
        engine.after_pass = lambda prefill: None
    assert events == [([], "cancelled", None)] and engine.prefill is None
    assert [e for e in engine.events if e[0] == "pass"] == [("pass", (40,), 0)]

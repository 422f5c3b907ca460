"""The OpenAI-compatible server, through the real `openai` client and raw HTTP against servers
started here on 127.0.0.1: concurrent greedy requests equal their solo outputs and
`api.generate`'s (speculative and autoregressive serving); seeded sampling does not depend on
the neighbours; streamed deltas join to the whole text; stop strings; every bad input gets a
400 naming its field, a full queue 429; a cancelled stream frees its slot; /metrics parses."""

import concurrent.futures as futures
import json
import time

import httpx
import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers import SMOLLM2, smollm2_cache, tiny_head, tiny_target
from jetspec_jax import api
from jetspec_jax.cli import BUILTIN_PROMPT
from jetspec_jax.io.load import Draft, Target
from jetspec_jax.serve.app import Server
from jetspec_jax.serve.engine import Engine, EngineConfig

TINY = "tiny"
MAX_LEN = 64


def start(target, draft, name, **config):
    engine = Engine(target, draft, EngineConfig(**config))
    return Server(engine, name).start()


@pytest.fixture(scope="module")
def tiny_models():
    tcfg, tparams = tiny_target("dense", seed=3, vocab=64)
    dcfg, dparams = tiny_head(tcfg, seed=4, block_size=5)
    return Target(tcfg, tparams, None, TINY), Draft(dcfg, dparams)


@pytest.fixture(scope="module")
def spec_server(tiny_models):
    server = start(*tiny_models, TINY, max_batch=8, slot_buckets=(8,), max_len=MAX_LEN,
                   budget=8, max_queue=32)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def chain_server(tiny_models):
    """The head's trees with context n-gram chains: the prompts of the slots' requests differ
    in length, the state keeps them padded to the cache."""
    server = start(*tiny_models, TINY, max_batch=8, slot_buckets=(8,), max_len=MAX_LEN,
                   budget=8, max_queue=32, ngram=3)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def ar_server(tiny_models):
    server = start(tiny_models[0], None, TINY, max_batch=8, slot_buckets=(8,), max_len=MAX_LEN,
                   max_queue=16)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def smol():
    with pytest.MonkeyPatch.context() as env:  # the run's converted copy (helpers.smollm2_cache)
        env.setenv("JETSPEC_CACHE", smollm2_cache())
        target = api.load_target(SMOLLM2, progress=False, use_cache=True)
    draft = api.load_draft(api.default_draft_path(target.name), target)
    server = start(target, draft, target.name, max_batch=2, slot_buckets=(2,), max_len=256)
    yield target, server
    server.stop()


def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def complete(server, prompt, max_tokens, **kw):
    """-> (token ids, the response) of one greedy /v1/completions request."""
    kw.setdefault("temperature", 0.0)
    r = client(server).completions.create(model=TINY, prompt=prompt, max_tokens=max_tokens,
                                          extra_body={"return_token_ids": True}, **kw)
    return r.choices[0].model_extra["token_ids"], r


def metrics(server) -> dict:
    text = httpx.get(server.url + "/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def wait_idle(server, timeout=30.0):
    deadline = time.monotonic() + timeout
    while metrics(server)[("jetspec_slots_active", ())] != 0:
        assert time.monotonic() < deadline, "slots still busy"
        time.sleep(0.05)


def requests_16(rng):
    prompts = [rng.integers(0, 64, size=int(rng.integers(1, 12))).tolist() for _ in range(16)]
    limits = [int(x) for x in rng.integers(4, 30, size=16)]
    return prompts, limits


@pytest.mark.parametrize("kind", ["speculative", "n-gram chains", "autoregressive"])
def test_16_concurrent_greedy_requests_equal_their_solo_outputs_and_generate(
        kind, tiny_models, request):
    server = request.getfixturevalue({"speculative": "spec_server", "n-gram chains": "chain_server",
                                      "autoregressive": "ar_server"}[kind])
    prompts, limits = requests_16(np.random.default_rng(0))
    solo = [complete(server, p, m)[0] for p, m in zip(prompts, limits)]
    with futures.ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(lambda a: complete(server, *a), zip(prompts, limits)))
    assert [ids for ids, _ in together] == solo
    # api.generate's greedy tokens, cut at each request's max_tokens (generation is a prefix).
    target = tiny_models[0]
    ref = api.generate(target, prompts, max_new_tokens=max(limits))
    assert solo == [t[:m] for t, m in zip(ref.tokens, limits)]
    for (ids, r), p, m in zip(together, prompts, limits):
        assert r.usage.prompt_tokens == len(p) and r.usage.completion_tokens == len(ids) == m
        assert r.choices[0].finish_reason == "length"


def test_seeded_sampling_does_not_depend_on_the_neighbours(spec_server):
    rng = np.random.default_rng(1)
    prompts, limits = requests_16(rng)
    sampled = dict(temperature=1.0, top_p=0.9, extra_body={"top_k": 20, "return_token_ids": True})

    def one(i):
        r = client(spec_server).completions.create(model=TINY, prompt=prompts[i], seed=100 + i,
                                                   max_tokens=limits[i], **sampled)
        return r.choices[0].model_extra["token_ids"]

    solo = [one(i) for i in range(4)]
    with futures.ThreadPoolExecutor(16) as pool:
        mixed = pool.map(lambda i: one(i) if i < 4 else complete(spec_server, prompts[i], 20),
                         range(16))
        assert list(mixed)[:4] == solo
    greedy = [complete(spec_server, prompts[i], limits[i])[0] for i in range(4)]
    assert solo != greedy  # the samples are not the greedy tokens


def test_smollm2_chat_stream_joins_to_the_whole_text_and_equals_generate(smol):
    target, server = smol
    c = client(server)
    # The CLI's built-in prompt at notebook 01's tiny length: the reference below is the
    # autoregressive program that notebook compiles (a test run builds it once).
    kw = dict(model=target.name, messages=[{"role": "user", "content": BUILTIN_PROMPT}],
              max_tokens=8, temperature=0.0)
    whole = c.chat.completions.create(**kw)
    text = whole.choices[0].message.content
    ref = api.generate(target, BUILTIN_PROMPT, max_new_tokens=8)  # autoregressive, chat template
    assert text == ref.texts[0] and whole.usage.completion_tokens == len(ref.tokens[0])
    chunks = list(c.chat.completions.create(stream=True, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    # A stop string: the text ends before it, in whole and streamed responses alike.
    cut = text.index(" ", len(text) // 2)
    stop = text[cut:cut + 3]
    stopped = c.chat.completions.create(stop=[stop], **kw).choices[0]
    assert stopped.message.content == text[:text.index(stop)]
    assert stopped.finish_reason == "stop"
    streamed = list(c.chat.completions.create(stop=stop, stream=True, **kw))
    assert "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices) == \
        stopped.message.content
    assert [m.id for m in c.models.list().data] == [target.name]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_a_cancelled_stream_frees_its_slot(smol):
    target, server = smol
    before = metrics(server).get(("jetspec_requests_total", (("outcome", "cancelled"),)), 0)
    body = dict(model=target.name, prompt="Once upon a time", max_tokens=200, temperature=0,
                stream=True)
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(2):
            assert next(line for line in lines if line.startswith("data: "))
    wait_idle(server)
    after = metrics(server)
    assert after[("jetspec_requests_total", (("outcome", "cancelled"),))] == before + 1
    assert after[("jetspec_slots_total", ())] == 2 and after[("jetspec_queue_depth", ())] == 0
    assert after[("jetspec_tau", ())] >= 1.0


@pytest.mark.parametrize("body, param, words", [
    (dict(model="gpt-4", prompt=[1, 2]), "model", "unknown model 'gpt-4'"),
    (dict(model=TINY, prompt=[1, 2], max_tokens=-1), "max_tokens", "greater than or equal to 1"),
    (dict(model=TINY, prompt=[1] * 60, max_tokens=8), "prompt", "context limit of 64"),
    (dict(model=TINY, prompt=[1, 99]), "prompt", "outside the vocab of 64"),
    (dict(model=TINY, prompt=[1], temperature=2.5), "temperature", "less than or equal to 2"),
    (dict(model=TINY, prompt=[1], top_p=0), "top_p", "greater than 0"),
    (dict(model=TINY, prompt="hello"), "prompt", "no tokenizer"),
    (dict(model=TINY, prompt=[]), "prompt", "empty"),
    (dict(model=TINY), "prompt", "Field required"),
    ('{"model": "tiny", "prompt": [1', "body", "malformed JSON"),
])
def test_each_bad_input_gets_a_400_naming_its_field(spec_server, body, param, words):
    kw = dict(content=body) if isinstance(body, str) else dict(json=body)
    r = httpx.post(spec_server.url + "/v1/completions", headers={
        "content-type": "application/json"}, **kw)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_the_openai_client_sees_bad_requests_and_the_server_keeps_serving(spec_server):
    with pytest.raises(openai.BadRequestError, match="unknown model"):
        client(spec_server).chat.completions.create(
            model="nope", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        client(spec_server).chat.completions.create(
            model=TINY, messages=[{"role": "user", "content": "hi"}])
    assert len(complete(spec_server, [5, 6], 5)[0]) == 5


def test_a_full_queue_answers_429_and_the_rest_complete(ar_server):
    def post(i):
        return httpx.post(ar_server.url + "/v1/completions", timeout=60, json=dict(
            model=TINY, prompt=[i % 60 + 1], max_tokens=MAX_LEN - 1, temperature=0))

    with futures.ThreadPoolExecutor(60) as pool:  # 16 waiting at most; slots fill at rounds
        codes = [r.status_code for r in pool.map(post, range(60))]
    # the first 16 arrivals always find room in the queue, and every admitted request completes
    assert set(codes) == {200, 429} and codes.count(200) >= 16
    wait_idle(ar_server)
    m = metrics(ar_server)
    assert m[("jetspec_rejected_total", (("reason", "queue_full"),))] == codes.count(429)


def test_row_sampler_mixes_greedy_and_sampled_rows_each_with_its_own_stream():
    import jax
    import jax.numpy as jnp

    from jetspec_jax.decode.sampling import RowSampler, choose_tokens, split_key

    logits = jax.random.normal(jax.random.key(0), (3, 5, 40))
    keys = jax.random.split(jax.random.key(1), 3)
    rows = RowSampler(temperature=jnp.asarray([0.0, 1.0, 1.0]), top_k=jnp.asarray([0, 1, 3]),
                      top_p=jnp.asarray([1.0, 1.0, 0.5]))
    out = np.asarray(choose_tokens(keys, logits, rows))
    best = np.asarray(jnp.argmax(logits, -1))
    assert (out[0] == best[0]).all() and (out[1] == best[1]).all()  # greedy; top_k=1
    top3 = np.argsort(-np.asarray(logits[2]), -1)[:, :3]
    assert all(t in row for t, row in zip(out[2], top3))
    # Row 2's draws depend on its own key only, not on the rows beside it.
    alone = choose_tokens(keys[2:], logits[2:], jax.tree.map(lambda x: x[2:], rows))
    assert (np.asarray(alone)[0] == out[2]).all()
    nxt, sub = split_key(keys)
    assert nxt.shape == sub.shape == (3,) and not (jax.random.key_data(nxt[0])
                                                   == jax.random.key_data(keys[0])).all()

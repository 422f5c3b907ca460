"""What the server makes of bad and hostile requests, against servers started here on
127.0.0.1 with a tiny random model: every field checked to its real range before anything
reaches the device (HTTP 400 naming the field), every error of any status an OpenAI error
object, generated bodies never answered with a 5xx; content as text parts; bodies past the size
limit refused with 413 before they are read, prompts tokenized beside the event loop so
/health keeps answering."""

import collections
import concurrent.futures as futures
import dataclasses
import json
import socket
import threading
import time

import httpx
import openai
import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st

from helpers import tiny_head, tiny_target
from jetspec_jax.cli import build_parser
from jetspec_jax.io.load import Draft, Target
from jetspec_jax.io.tokenizer import Tokenizer
from jetspec_jax.serve import protocol
from jetspec_jax.serve.app import Server, Text
from jetspec_jax.serve.engine import Engine, EngineConfig
from test_api_cli import VOCAB, word_tokenizer
from test_server import client, metrics

NAME = "tiny-chat"
MAX_LEN = 64


@pytest.fixture(scope="module")
def models():
    tcfg, tparams = tiny_target("dense", seed=5, vocab=VOCAB)
    dcfg, dparams = tiny_head(tcfg, seed=6, block_size=5)
    tok = word_tokenizer()  # with a switch in its template, as Qwen3's
    return Target(tcfg, tparams, tok, NAME), Draft(dcfg, dparams)


@pytest.fixture(scope="module")
def server(models):
    config = EngineConfig(max_batch=4, slot_buckets=(4,), max_len=MAX_LEN, budget=8,
                          max_queue=32)
    server = Server(Engine(*models, config), NAME).start()
    yield server
    server.stop()


def post(server, path, body, **kw):
    return httpx.post(server.url + path, json=body, timeout=60, **kw)


def error_of(r: httpx.Response) -> dict:
    """The OpenAI error object of a response, checked for its four keys."""
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    return error


def chat_body(content, **kw):
    return dict(model=NAME, messages=[{"role": "user", "content": content}], **kw)


@pytest.mark.parametrize("path, body, param, words", [
    ("/v1/completions", dict(prompt=[1], top_k=10**12), "top_k", "exceeds the vocab of 32"),
    ("/v1/completions", dict(prompt=[1], top_k=VOCAB + 1), "top_k", "exceeds the vocab"),
    ("/v1/completions", dict(prompt=[1], seed=2**70), "seed", "less than 9223372036854775808"),
    ("/v1/completions", dict(prompt=[1], seed=-2**63 - 1), "seed", "greater than or equal"),
    ("/v1/completions", dict(prompt=[1], max_tokens=10**9), "max_tokens", "context limit of 64"),
    ("/v1/completions", dict(prompt=[1], max_tokens=MAX_LEN), "max_tokens", "at most 63"),
    ("/v1/completions", dict(prompt=[2**40, 1]), "prompt", "outside the vocab"),
    ("/v1/completions", dict(prompt=[-2**40]), "prompt", "outside the vocab"),
    ("/v1/completions", dict(prompt=[1], max_tokens=None, n=2), "n", "less than or equal to 1"),
    ("/v1/chat/completions", chat_body("w1", max_tokens=10**9), "max_tokens", "context limit"),
    ("/v1/chat/completions", chat_body("w1", max_completion_tokens=10**9),
     "max_completion_tokens", "context limit"),
    ("/v1/chat/completions", chat_body([{"type": "image_url", "image_url": {"url": "x"}}]),
     "messages.0.content", "type 'image_url' are not supported"),
    ("/v1/chat/completions", chat_body([{"type": "text"}]), "messages.0.content",
     "needs 'text'"),
    ("/v1/chat/completions", chat_body(5), "messages.0.content", "valid string"),
    ("/v1/chat/completions", [1, 2], "body", "valid dictionary"),
])
def test_each_field_is_checked_to_its_real_range(server, path, body, param, words):
    if isinstance(body, dict):
        body.setdefault("model", NAME)
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    error = error_of(r)
    assert error["param"] == param and words in error["message"], error
    assert error["type"] == "invalid_request_error"


def test_the_largest_seed_and_top_k_in_range_decode(server):
    for seed in (2**63 - 1, -2**63, 2**32):
        r = post(server, "/v1/completions", dict(model=NAME, prompt=[1, 2], max_tokens=3,
                                                 seed=seed, top_k=VOCAB))
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text


def test_seeds_past_32_bits_draw_their_own_streams(server):
    def sample(seed):
        body = dict(model=NAME, prompt=[3], max_tokens=24, seed=seed, temperature=2.0,
                    return_token_ids=True)
        return post(server, "/v1/completions", body).json()["choices"][0]["token_ids"]

    assert sample(7) == sample(7)
    assert sample(7) != sample(7 + 2**32) != sample(7 - 2**32)


def test_unknown_paths_and_wrong_methods_answer_openai_errors(server):
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and "/v1/nothing" in error_of(r)["message"]
    r = httpx.get(server.url + "/v1/completions")
    assert r.status_code == 405 and "GET /v1/completions" in error_of(r)["message"]
    assert r.headers["allow"] == "POST"


@pytest.mark.parametrize("kind", ["text/plain", "application/x-www-form-urlencoded",
                                  "multipart/form-data; boundary=x"])
def test_a_body_that_is_not_json_gets_415_naming_its_content_type(server, kind):
    r = httpx.post(server.url + "/v1/completions", content=b'{"model": "tiny-chat"}',
                   headers={"content-type": kind})
    assert r.status_code == 415, r.text
    assert repr(kind) in error_of(r)["message"] and "application/json" in error_of(r)["message"]


def test_json_bodies_are_read_with_or_without_a_json_content_type(server):
    body = b'{"model": "tiny-chat", "prompt": [1, 2], "max_tokens": 2}'
    for headers in ({"content-type": "application/json; charset=utf-8"}, {}):
        r = httpx.post(server.url + "/v1/completions", content=body, headers=headers)
        assert r.status_code == 200, r.text


def test_content_as_text_parts_equals_the_joined_text(server):
    def ids(content):
        r = post(server, "/v1/chat/completions", chat_body(
            content, max_tokens=6, temperature=0, return_token_ids=True))
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"], r.json()["usage"]["prompt_tokens"]

    parts = [{"type": "text", "text": "w1 w2"}, {"type": "text", "text": "w3"}]
    assert ids(parts) == ids("w1 w2\nw3")
    assert ids(parts)[1] == 5  # <user> w1 w2 w3 <bot>: each part's words reach the prompt


# ---- generated bodies ------------------------------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                max_size=3),
    max_leaves=6)
BIG = st.sampled_from([0, -1, 1, 2, VOCAB, MAX_LEN, 2**31, 2**32, 2**63, 2**64, 10**30, -2**63])
NUMBER = BIG | st.integers(-3, 80) | st.floats(-3, 3) | JSON
IDS = st.lists(BIG | st.integers(0, VOCAB + 2), min_size=0, max_size=5)
PART = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "x"]) | JSON},
                             optional={"text": st.text(max_size=8) | JSON})
CONTENT = st.text(max_size=12) | st.lists(PART, max_size=3) | JSON
MESSAGE = st.fixed_dictionaries({}, optional={
    "role": st.sampled_from(["user", "system", "assistant", "tool", "robot"]) | JSON,
    "content": CONTENT})
FIELDS = {
    "model": st.sampled_from([NAME, "gpt-4"]) | JSON,
    "prompt": IDS | st.text(max_size=12) | JSON,
    "messages": st.lists(MESSAGE, max_size=3) | JSON, "max_tokens": NUMBER,
    "max_completion_tokens": NUMBER, "temperature": NUMBER, "top_p": NUMBER, "top_k": NUMBER,
    "seed": NUMBER, "stop": st.lists(st.text(max_size=3), max_size=5) | JSON, "n": NUMBER,
    "stream": st.booleans() | JSON, "return_token_ids": st.booleans() | JSON,
    "chat_template_kwargs": st.dictionaries(
        st.sampled_from(["enable_thinking", "messages", "self", "x"]), JSON, max_size=2) | JSON,
}
VALID = {"/v1/completions": dict(model=NAME, prompt=[1, 2], max_tokens=4),
         "/v1/chat/completions": chat_body("w1 w2", max_tokens=4)}
REQUIRED = {path: {name for name, field in model.model_fields.items() if field.is_required()}
            for path, model in (("/v1/completions", protocol.CompletionRequest),
                                ("/v1/chat/completions", protocol.ChatRequest))}
CHANGE = st.sampled_from(sorted(FIELDS)).flatmap(lambda k: st.tuples(st.just(k), FIELDS[k]))
# a valid body with up to 3 fields set to generated values, or any JSON value
REQUEST = st.sampled_from(sorted(VALID)).flatmap(lambda path: st.tuples(
    st.just(path), st.lists(CHANGE, max_size=3).map(lambda c: {**VALID[path], **dict(c)})
    | JSON))


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(request=REQUEST)
def test_generated_bodies_get_no_5xx_and_every_4xx_names_its_field(server, request):
    path, body = request
    with httpx.Client(timeout=60) as http:
        # json.dumps writes NaN and Infinity, which Python's parser reads back
        r = http.post(server.url + path, content=json.dumps(body),
                      headers={"content-type": "application/json"})
        text = r.read().decode()
    assert r.status_code < 500, text
    event(f"HTTP {r.status_code}")  # --hypothesis-show-statistics: how many bodies were served
    if r.status_code == 200:
        assert "server_error" not in text, text
        return
    assert r.status_code == 400, text
    param = error_of(r)["param"]
    # a field of the body, or a required one it lacks
    fields = set(body) | REQUIRED[path] if isinstance(body, dict) else set()
    assert param == "body" or param.split(".")[0] in fields, (param, body)


# ---- body size and tokenization off the event loop -------------------------------------------

EIGHT_MB = b'{"model": "tiny-chat", "prompt": "' + b"w1 " * ((8 << 20) // 3) + b'"}'


class SlowTokenizer(Tokenizer):
    """The word tokenizer, taking `delay` seconds a prompt: a long prompt stands in for it."""

    delay = 0.5

    def encode(self, text, add_special_tokens=True):
        time.sleep(self.delay)
        return super().encode(text, add_special_tokens)


@pytest.fixture(scope="module")
def slow_server(models):
    target, draft = models
    tok = target.tokenizer
    slow = SlowTokenizer(tok.backend, chat_template=tok.chat_template,
                         special_tokens=tok.special_tokens, eos_token_ids=tok.eos_token_ids)
    config = EngineConfig(max_batch=4, slot_buckets=(4,), max_len=MAX_LEN, budget=8)
    server = Server(Engine(dataclasses.replace(target, tokenizer=slow), draft, config),
                    NAME).start()
    yield server
    server.stop()


def raw_post(server, headers: dict, body: bytes) -> bytes:
    """Sends headers and the first bytes of a body over a raw socket -> what the server answers
    before the rest arrives."""
    host, port = server.server.servers[0].sockets[0].getsockname()[:2]
    with socket.create_connection((host, port), timeout=30) as sock:
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\n{head}\r\n".encode()
                     + body)
        return sock.recv(65536)


def test_an_oversized_body_is_refused_413_from_its_content_length_before_it_is_read(server):
    answer = raw_post(server, {"content-type": "application/json",
                               "content-length": len(EIGHT_MB)}, EIGHT_MB[:1000])
    assert answer.startswith(b"HTTP/1.1 413 ")
    error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
    assert "limit of 1048576 bytes" in error["message"] and error["type"] == (
        "invalid_request_error")


def test_an_oversized_chunked_body_is_refused_413_while_it_is_read(server):
    pieces = (EIGHT_MB[i:i + 65536] for i in range(0, len(EIGHT_MB), 65536))
    r = httpx.post(server.url + "/v1/completions", content=pieces, timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and "limit of 1048576" in error_of(r)["message"]
    assert "transfer-encoding" in r.request.headers  # sent without a Content-Length


def test_a_body_within_the_limit_is_read_and_the_limit_is_an_option(models, server):
    words = b"w1 " * ((1 << 20) // 3 - 20)  # a body just under 1 MiB: read and tokenized
    r = httpx.post(server.url + "/v1/completions", content=b'{"model": "tiny-chat", '
                   b'"prompt": "' + words + b'"}', timeout=60)
    assert r.status_code == 400 and "context limit" in error_of(r)["message"], r.text
    config = EngineConfig(max_batch=1, max_len=MAX_LEN)
    small = Server(Engine(models[0], None, config), NAME, max_body_bytes=100).start()
    try:
        body = dict(model=NAME, prompt=[1, 2], max_tokens=2)
        assert post(small, "/v1/completions", body).status_code == 200
        r = post(small, "/v1/completions", body | dict(stop=["x" * 100]))
        assert r.status_code == 413 and "limit of 100 bytes" in error_of(r)["message"]
    finally:
        small.stop()


def test_health_answers_while_8mb_bodies_are_refused_and_prompts_tokenized(slow_server):
    """/health's latency under that load against its latency without it, in the same run (a
    bound that holds on a busy machine): big bodies are refused before they are read, and
    tokenizing (SlowTokenizer: 0.5 s a prompt) runs beside the event loop, not on it."""
    def latencies(http, n=20):
        out = []
        for _ in range(n):
            t = time.perf_counter()
            assert http.get(slow_server.url + "/health").status_code == 200
            out.append(time.perf_counter() - t)
            time.sleep(0.02)
        return sorted(out)

    def load(stop: threading.Event):
        pieces = [EIGHT_MB[i:i + 65536] for i in range(0, len(EIGHT_MB), 65536)]
        with httpx.Client(timeout=60) as http:
            while not stop.is_set():
                for content in (EIGHT_MB, iter(pieces)):
                    assert http.post(slow_server.url + "/v1/completions",
                                     content=content).status_code == 413
                r = http.post(slow_server.url + "/v1/completions", json=dict(
                    model=NAME, prompt="w1 w2", max_tokens=2))
                assert r.status_code == 200, r.text

    with httpx.Client() as http, futures.ThreadPoolExecutor(2) as pool:
        calm = latencies(http)
        stop = threading.Event()
        senders = [pool.submit(load, stop) for _ in range(2)]
        time.sleep(0.3)
        busy = latencies(http)
        stop.set()
        for sender in senders:
            sender.result()
    median = busy[len(busy) // 2]
    assert median < max(0.05, 10 * calm[len(calm) // 2]), (calm, busy)
    assert busy[-1] < 0.25 + 10 * calm[-1], (calm, busy)  # none waited for a 0.5 s prompt


# ---- clients that leave ------------------------------------------------------------------------


class SlowEngine(Engine):
    """An engine whose device calls take `delay` seconds more: requests stay in their rows
    long enough to be watched."""

    delay = 0.2

    def _run_round(self, active):
        time.sleep(self.delay)
        return super()._run_round(active)


@pytest.fixture(scope="module")
def slow_engine_server(models):
    config = EngineConfig(max_batch=4, slot_buckets=(4,), max_len=MAX_LEN, budget=8, chunk=1,
                          max_queue=32)
    server = Server(SlowEngine(*models, config), NAME).start()
    post(server, "/v1/completions", dict(model=NAME, prompt=[1], max_tokens=1))  # compiles
    yield server
    server.stop()


def test_non_streaming_clients_that_time_out_free_their_rows_a_round_later(slow_engine_server):
    server, engine = slow_engine_server, slow_engine_server.engine
    before = engine.metrics.get("requests", outcome="cancelled")
    body = dict(model=NAME, prompt=[1], max_tokens=MAX_LEN - 1, temperature=0)

    def give_up(_):  # decoding all 24 takes 6 batches of at least 12 calls of 0.2 s each
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", json=body, timeout=1.0)
        return time.monotonic()

    with futures.ThreadPoolExecutor(24) as pool:
        last = max(pool.map(give_up, range(24)))
    while engine.slots or engine.queue:
        assert time.monotonic() - last < 3 * SlowEngine.delay + 0.5, "rows still busy"
        time.sleep(0.01)
    deadline = time.monotonic() + 5
    while engine.metrics.get("requests", outcome="cancelled") < before + 24:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert engine.metrics.get("generated_tokens") < 24 * (MAX_LEN - 1) / 4


# ---- gauges ------------------------------------------------------------------------------------


def test_gauges_count_the_rows_and_queue_in_use_while_requests_are_served(slow_engine_server):
    """One request of one token joins and leaves within a device call; 6 at once fill the 4
    rows and queue 2. The gauges read while that call runs."""
    server = slow_engine_server
    seen = collections.defaultdict(float)
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            for (name, _), value in metrics(server).items():
                seen[name] = max(seen[name], value)

    def ask(max_tokens):
        r = post(server, "/v1/completions", dict(model=NAME, prompt=[1], max_tokens=max_tokens))
        assert r.status_code == 200, r.text

    with futures.ThreadPoolExecutor(7) as pool:
        watcher = pool.submit(watch)
        try:
            ask(1)
            alone = dict(seen)
            list(pool.map(ask, [6] * 6))
        finally:
            stop.set()
            watcher.result()
    assert alone["jetspec_slots_active"] == 1, alone
    assert seen["jetspec_slots_active"] == 4 and seen["jetspec_queue_depth"] >= 1, seen
    assert seen["jetspec_round_tokens"] >= 1
    after = metrics(server)
    assert after[("jetspec_slots_active", ())] == after[("jetspec_queue_depth", ())] == 0
    assert after[("jetspec_tau", ())] >= 1


# ---- API keys ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def keyed_server(models):
    config = EngineConfig(max_batch=1, max_len=MAX_LEN)
    server = Server(Engine(models[0], None, config), NAME, api_key="sk-right").start()
    yield server
    server.stop()


@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer sk-wrong"},
                                     {"authorization": "Bearer sk-righ"},
                                     {"authorization": "Basic sk-right"},
                                     {"authorization": "sk-right"}])
def test_requests_without_the_api_key_get_401(keyed_server, headers):
    for method, path in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                         ("GET", "/v1/models")):
        r = httpx.request(method, keyed_server.url + path, headers=headers,
                          json=dict(model=NAME, prompt=[1], max_tokens=1))
        assert r.status_code == 401, r.text
        error = error_of(r)
        assert error["code"] == "invalid_api_key" and "Bearer" in error["message"]
        assert r.headers["www-authenticate"] == "Bearer"


def test_the_api_key_admits_the_openai_client_and_probes_need_none(keyed_server):
    with pytest.raises(openai.AuthenticationError):
        client(keyed_server).models.list()
    right = openai.OpenAI(base_url=keyed_server.url + "/v1", api_key="sk-right", max_retries=0)
    assert right.completions.create(model=NAME, prompt=[1, 2], max_tokens=2).usage.total_tokens
    assert httpx.get(keyed_server.url + "/health").json() == {"status": "ok"}
    assert httpx.get(keyed_server.url + "/metrics").status_code == 200


def test_serve_reads_its_api_key_from_the_flag_or_the_environment(monkeypatch):
    monkeypatch.setenv("JETSPEC_API_KEY", "sk-env")
    assert build_parser().parse_args(["serve"]).api_key == "sk-env"
    assert build_parser().parse_args(["serve", "--api-key", "sk-flag"]).api_key == "sk-flag"
    monkeypatch.delenv("JETSPEC_API_KEY")
    assert build_parser().parse_args(["serve"]).api_key is None


# ---- what each response tells --------------------------------------------------------------


def test_usage_carries_the_requests_rounds_and_tokens_per_round(server, keyed_server):
    body = dict(model=NAME, prompt=[1, 2], max_tokens=12, temperature=0)
    whole = post(server, "/v1/completions", body).json()["usage"]["speculative"]
    assert whole["rounds"] >= 1 and 1 <= whole["tokens_per_round"] <= 6  # block size 5, + 1
    with httpx.stream("POST", server.url + "/v1/completions", json=body | dict(stream=True),
                      timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    assert chunks[-1]["usage"]["speculative"] == whole  # greedy: the same rounds
    autoregressive = post(keyed_server, "/v1/completions", body,
                          headers={"authorization": "Bearer sk-right"}).json()["usage"]
    assert "speculative" not in autoregressive


def test_chat_template_kwargs_reach_the_template(server):
    def prompt_tokens(**kw):
        r = post(server, "/v1/chat/completions", chat_body("w1", max_tokens=1, **kw))
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    assert prompt_tokens() == prompt_tokens(chat_template_kwargs={"enable_thinking": True}) == 3
    assert prompt_tokens(chat_template_kwargs={"enable_thinking": False}) == 4
    r = post(server, "/v1/chat/completions", chat_body(
        "w1", chat_template_kwargs={"messages": []}))
    assert r.status_code == 400 and error_of(r)["param"] == "chat_template_kwargs"


def test_the_servers_template_variables_apply_to_requests_that_do_not_set_them(server):
    """`serve --no-enable-thinking`: enable_thinking false unless a request sets it."""
    second = Server(server.engine, NAME, chat_template_kwargs={"enable_thinking": False})
    second.start()  # a second app over the same running engine
    try:
        def prompt_tokens(**kw):
            r = post(second, "/v1/chat/completions", chat_body("w1", max_tokens=1, **kw))
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens"]

        assert prompt_tokens() == 4
        assert prompt_tokens(chat_template_kwargs={"enable_thinking": True}) == 3
    finally:  # its HTTP side only: the engine is the module's server's
        second.server.should_exit = True
        second.thread.join()


class Letters:
    """Token i is the letter chr(97 + i)."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(97 + i) for i in ids)


def test_a_long_stop_string_costs_what_the_text_does():
    """The text held back as a stop string's possible beginning is looked for within the text's
    length, so a stop string near the body limit does not stall the event loop token by token."""
    class Counted(str):
        slices = 0

        def __getitem__(self, key):
            Counted.slices += 1
            return str.__getitem__(self, key)

    text = Text(Letters(), [Counted("x" * 500_000), "cd"])
    assert [text.add([i], final=False) for i in range(3)] == [("a", False), ("b", False),
                                                              ("", False)]
    assert text.add([3], final=False) == ("", True)  # "abcd" stops before "cd"
    assert Counted.slices <= 4 * 5


def test_an_unforeseen_failure_answers_500_in_the_openai_format(models):
    class Broken(Tokenizer):
        def encode(self, text, add_special_tokens=True):
            raise RuntimeError("a tokenizer that fails")

    target = dataclasses.replace(models[0], tokenizer=Broken(models[0].tokenizer.backend))
    server = Server(Engine(target, None, EngineConfig(max_batch=1, max_len=MAX_LEN)),
                    NAME).start()
    try:
        r = post(server, "/v1/completions", dict(model=NAME, prompt="w1"))
    finally:
        server.stop()
    assert r.status_code == 500
    error = error_of(r)
    assert error["type"] == "server_error" and "RuntimeError" in error["message"]

"""`dsv4-chat serve` on the demo model: a live uvicorn server on 127.0.0.1 (ephemeral port) in a
thread, driven by the real `openai` client and by raw HTTP where the client hides the wire."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time

import openai
import pytest
import uvicorn

from app.demo import ensure_demo_model
from app.server.api import ServerConfig, body_limit, build_app
from app.server.pool import SessionPool
from app.server.request import ChatRequest
from app.server.runner import Server
from app.server.stops import StopScanner
from app.server.worker import Failed, Job, Worker
from engine.chat import Message
from engine.config import EngineConfig
from engine.engine import Engine
from engine.events import TurnFinished
from engine.sampling import SamplingParams

KEY = "sk-test-key"
DEFAULTS = SamplingParams(temperature=0.8, top_p=1.0, top_k=0, max_tokens=4)


class LiveServer:
    """`dsv4-chat serve`'s uvicorn server (app.server.runner) serving `app` on
    127.0.0.1:<ephemeral> in the thread "test-uvicorn"."""

    def __init__(self, app) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = Server(uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5),
                             app.state.api.worker)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="test-uvicorn")

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()
        assert not self.thread.is_alive()


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return ensure_demo_model(tmp_path_factory.mktemp("data"), lambda p: None)


@pytest.fixture(scope="module")
def engine(demo_dir):
    eng = Engine.load(demo_dir, EngineConfig())
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def direct(demo_dir):
    """A second engine on the same model, called directly: the reference for the server's text."""
    eng = Engine.load(demo_dir, EngineConfig())
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def server(engine):
    config = ServerConfig(api_key=KEY, max_queue=1, max_sessions=4, keepalive_s=0.02, defaults=DEFAULTS)
    app = build_app(engine, config)
    with LiveServer(app) as live:
        live.api = app.state.api
        yield live


@pytest.fixture
def client(server):
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key=KEY, max_retries=0, timeout=60)
    yield c
    c.close()


def raw(server, method: str, path: str, body=None, key: str | None = KEY, timeout: float = 60):
    """(status, headers, parsed JSON body) of one plain HTTP request."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout)
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    conn.request(method, path, body=data, headers=headers)
    resp = conn.getresponse()
    text = resp.read().decode()
    conn.close()
    assert "Traceback" not in text
    return resp.status, dict(resp.getheaders()), json.loads(text)


def open_stream(server, body: dict) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(dict(body, stream=True)).encode(),
                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("content-type").startswith("text/event-stream")
    return conn, resp


def sse_lines(resp):
    """The non-empty lines of an SSE body as they arrive."""
    while True:
        line = resp.readline()
        if not line:
            return
        line = line.decode().rstrip("\n")
        if line:
            yield line


def reference(direct, system, turns, params):
    """TurnFinished events of `turns` (user texts) answered in one session of the direct engine."""
    session = direct.new_session(system=system)
    out = []
    for text in turns:
        out.append([ev for ev in direct.generate(session, text, params)][-1])
        assert isinstance(out[-1], TurnFinished)
    return out


def params(**kw) -> SamplingParams:
    base = dict(temperature=DEFAULTS.temperature, top_p=DEFAULTS.top_p, top_k=DEFAULTS.top_k,
                max_tokens=DEFAULTS.max_tokens)
    return SamplingParams(**dict(base, **kw))


def test_models_health_and_stats(server, client):
    assert [m.id for m in client.models.list().data] == ["demo"]
    status, _, body = raw(server, "GET", "/health", key=None)  # no key needed
    assert status == 200 and body["status"] == "ok" and body["model"] == "demo"
    status, _, stats = raw(server, "GET", "/v1/stats")
    assert status == 200 and stats["engine"]["demo"] is True
    assert {"requests", "sessions"} <= set(stats) and stats["requests"]["max_queue"] == 1


def test_non_streamed_and_streamed_completions(server, client, direct):
    msgs = [{"role": "user", "content": "Tell me about the sea."}]
    want = reference(direct, None, ["Tell me about the sea."], params(seed=7, max_tokens=3))[0]
    out = client.chat.completions.create(model="demo", messages=msgs, max_tokens=3, seed=7)
    choice = out.choices[0]
    assert out.object == "chat.completion" and out.model == "demo"
    assert choice.message.role == "assistant" and choice.message.content == want.content
    assert choice.finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (want.stats.prompt_tokens, 3)
    assert out.usage.total_tokens == want.stats.prompt_tokens + 3

    chunks = list(client.chat.completions.create(model="demo", messages=msgs, max_completion_tokens=3, seed=7,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"


def test_three_turns_reuse_the_kv_and_match_the_engine(server, client, direct):
    system, users = "You answer briefly.", ["Hello there.", "What is a cache?", "And a pool?"]
    want = reference(direct, system, users, params(seed=11))
    msgs = [{"role": "system", "content": system}]
    got = []
    for i, user in enumerate(users):
        msgs.append({"role": "user", "content": user})
        if i == 1:  # one streamed turn: usage comes in the last chunk
            chunks = list(client.chat.completions.create(model="demo", messages=msgs, seed=11, stream=True,
                                                         stream_options={"include_usage": True}))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            usage = chunks[-1].usage
        else:
            out = client.chat.completions.create(model="demo", messages=msgs, seed=11)
            text, usage = out.choices[0].message.content, out.usage
        got.append((text, usage))
        msgs.append({"role": "assistant", "content": text})
    for (text, usage), ref in zip(got, want):
        assert text == ref.content
        assert usage.prompt_tokens == ref.stats.prompt_tokens
        assert usage.prompt_tokens_details.cached_tokens == ref.stats.reused_tokens
    assert got[0][1].prompt_tokens_details.cached_tokens == 0
    # turns 2 and 3 reuse everything before their new user message (but the last sampled token,
    # which is run first when the turn ended at max_tokens)
    for (_, usage), (_, before) in zip(got[1:], got[:-1]):
        assert usage.prompt_tokens_details.cached_tokens in (before.total_tokens - 1, before.total_tokens)


def test_disconnect_cancels_and_the_next_request_starts_at_once(server, client):
    before = raw(server, "GET", "/v1/stats")[2]["requests"]["cancelled"]
    stream = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Go on."}],
                                            max_tokens=3000, stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            break
    stream.close()  # the client goes away mid-stream (3000 tokens would take minutes here)
    t0 = time.monotonic()
    out = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Next."}], max_tokens=2)
    assert out.choices[0].finish_reason == "length"
    assert time.monotonic() - t0 < 10
    stats = raw(server, "GET", "/v1/stats")[2]["requests"]
    assert stats["cancelled"] == before + 1
    cancelled = [t for t in stats["recent_turns"] if t["finish_reason"] == "cancelled"][-1]
    assert 1 <= cancelled["completion_tokens"] < 300


def test_two_concurrent_requests_run_one_after_the_other(server, client):
    results = {}

    def ask(name):
        results[name] = client.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": f"Request {name}."}], max_tokens=6)

    threads = [threading.Thread(target=ask, args=(n,), name=f"test-client-{n}") for n in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert {n: r.usage.completion_tokens for n, r in results.items()} == {"a": 6, "b": 6}
    first, second = sorted(raw(server, "GET", "/v1/stats")[2]["requests"]["recent_turns"][-2:],
                           key=lambda t: t["started_s"])
    assert second["started_s"] >= first["ended_s"]  # batch 1: no overlap


def test_queue_limit_answers_429_with_retry_after(server, client):
    running = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Long one."}],
                                             max_tokens=3000, stream=True)
    next(c for c in running if c.choices and c.choices[0].delta.content)  # it is generating now
    conn, waiting = open_stream(server, {"messages": [{"role": "user", "content": "Waiting."}], "max_tokens": 2})
    lines = sse_lines(waiting)
    assert next(lines) == ": keep-alive"  # headers and keep-alives go out while it waits
    assert raw(server, "GET", "/v1/stats")[2]["requests"]["queued"] == 1
    with pytest.raises(openai.RateLimitError) as err:
        client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Third."}], max_tokens=2)
    assert err.value.status_code == 429 and int(err.value.response.headers["retry-after"]) >= 1
    assert err.value.body["type"] == "rate_limit_error" and "busy" in err.value.body["message"]
    running.close()  # cancels the running request: the waiting one starts
    data = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    conn.close()
    assert data[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert data[-1]["choices"][0]["finish_reason"] == "length"


def test_keep_alive_comments_during_prefill(server):
    long_prompt = " ".join(f"word{i}" for i in range(400))
    conn, resp = open_stream(server, {"messages": [{"role": "user", "content": long_prompt}], "max_tokens": 2})
    lines = list(sse_lines(resp))
    conn.close()
    role = lines.index(next(line for line in lines if '"role": "assistant"' in line))
    first_text = next(i for i, line in enumerate(lines) if '"content": "' in line and '"content": ""' not in line)
    assert ": keep-alive" in lines[role + 1:first_text]  # between the start of the turn and its first token
    assert lines[-1] == "data: [DONE]"


def test_bad_requests_get_400_openai_bodies(server, client):
    user = [{"role": "user", "content": "Hi"}]
    cases = [
        (b'{"messages": [', None, "not valid JSON"),
        ({"messages": user, "max_tokns": 3}, "max_tokns", "unsupported field 'max_tokns'"),
        ({"messages": [{"role": "assistant", "content": "x"}]}, "messages", "last message must come from the user"),
        ({"messages": user, "temperature": 5}, "temperature", "'temperature' must be a number in [0.0, 2.0]"),
        ({"messages": user, "top_k": 2**64}, "top_k", "'top_k' must be an integer in [0, 1,048,576]"),
        ({"messages": user, "max_tokens": 2**63}, "max_tokens", "'max_tokens' must be an integer in [1, 1,048,576]"),
        ({"messages": user, "max_completion_tokens": 0}, "max_completion_tokens", "must be an integer in [1, "),
        ({"messages": user, "tools": []}, "tools", "unsupported field 'tools'"),
        ({"messages": [{"role": "user", "content": "word " * 5000}]}, "messages", "over the context limit"),
        ([1, 2], None, "must be a JSON object"),
    ]
    for body, param, message in cases:
        status, _, got = raw(server, "POST", "/v1/chat/completions", body)
        assert status == 400, body
        assert set(got) == {"error"} and got["error"]["type"] == "invalid_request_error"
        assert got["error"]["param"] == param and message in got["error"]["message"]
    assert got["error"]["code"] is None
    assert raw(server, "POST", "/v1/chat/completions",
               {"messages": [{"role": "user", "content": "word " * 5000}]})[2]["error"]["code"] == \
        "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="demo", messages=user, max_tokens=2, extra_body={"top_q": 1})
    assert err.value.status_code == 400 and err.value.body["param"] == "top_q"
    assert raw(server, "GET", "/v1/nothing")[0] == 404


def test_api_key_401(server):
    for key in (None, "wrong"):
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("GET", "/v1/stats")):
            status, headers, body = raw(server, method, path, {"messages": []} if method == "POST" else None, key=key)
            assert status == 401 and headers["www-authenticate"] == "Bearer"
            assert body["error"]["code"] == "invalid_api_key" and "Authorization: Bearer" in body["error"]["message"]
    bad = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    bad.close()


def test_stop_strings_cut_the_answer(server, client, direct):
    msgs = [{"role": "user", "content": "Count for me."}]
    full = reference(direct, None, ["Count for me."], params(seed=3, max_tokens=8))[0].content
    stop = full[len(full) // 2: len(full) // 2 + 2]
    assert stop.strip() and full.index(stop) > 0
    out = client.chat.completions.create(model="demo", messages=msgs, max_tokens=8, seed=3, stop=[stop])
    assert out.choices[0].message.content == full[:full.index(stop)]
    assert out.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(model="demo", messages=msgs, max_tokens=8, seed=3, stop=stop,
                                                 stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full[:full.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_thinking_streams_reasoning_content(server, client, direct):
    want = reference(direct, None, ["Think first."], params(seed=5, thinking=True))[0]
    chunks = list(client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Think first."}],
                                                 seed=5, stream=True, extra_body={"thinking": {"type": "enabled"}}))
    deltas = [c.choices[0].delta for c in chunks]
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    assert (reasoning, content) == (want.reasoning, want.content) and reasoning
    out = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Think first."}],
                                         seed=5, extra_body={"chat_template_kwargs": {"thinking": True}})
    assert out.choices[0].message.reasoning_content == want.reasoning


def test_pool_keeps_the_most_recent_conversations(engine):
    pool = SessionPool(engine, max_sessions=2)
    p = params(seed=1, max_tokens=2)

    def turn(history, user):
        key, session = pool.checkout("sys", history)
        end = [ev for ev in engine.generate(session, user, p)][-1]
        pool.checkin(key, session)
        return end

    first = {name: turn([], f"Conversation {name}.") for name in "abc"}  # a is evicted by c
    follow = {name: turn([Message("user", f"Conversation {name}."), Message("assistant", first[name].content)],
                         "More.") for name in "cb"}
    assert follow["c"].stats.reused_tokens > 0 and follow["b"].stats.reused_tokens > 0
    again = turn([Message("user", "Conversation a."), Message("assistant", first["a"].content)], "More.")
    assert again.stats.reused_tokens == 0  # evicted: prefilled from scratch
    assert pool.stats()["sessions"] == 2 and pool.stats()["evictions"] == 2


def test_stop_scanner_holds_back_partial_stops():
    s = StopScanner(["END", "xy"])
    assert s.push("abcE") == ("abc", False)
    assert s.push("N") == ("", False)
    assert s.push("Dzz") == ("", True)
    s = StopScanner(["END"])
    assert s.push("abEN") == ("ab", False) and s.flush() == "EN"


def test_serve_subcommand_rejects_bad_flags_in_one_line(capsys, tmp_path):
    from app.__main__ import main

    assert main(["serve", "--port", "70000"]) == 2
    assert capsys.readouterr().err == "dsv4-chat serve: --port must be in 1-65535, got 70000\n"
    assert main(["serve", "--api-key", "clé"]) == 2
    assert capsys.readouterr().err == "dsv4-chat serve: --api-key must be printable ASCII: HTTP clients send it in a header\n"
    with socket.socket() as busy:  # a port in use is found before the model loads (a missing one here)
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--port", str(port), "--model", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert err == f"dsv4-chat serve: cannot listen on 127.0.0.1:{port}: Address already in use; choose another " \
                  "--port, or stop the program that holds it\n"
    for argv in (["serve", "--model", str(tmp_path / "none")], ["--model", str(tmp_path / "none"), "serve"]):
        assert main(argv) == 2  # the shared options before or after `serve`
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "does not exist" in err and "Traceback" not in err
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--max-queue", "many"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == ("dsv4-chat serve: error: argument --max-queue: invalid int value: 'many' "
                                       "(see dsv4-chat serve --help)\n")
    from app.__main__ import parser

    assert "serve" in parser().format_help()


def test_values_json_allows_but_no_sampler_or_tokenizer_takes_get_400(server):
    user = '[{"role": "user", "content": "Hi"}]'
    cases = [
        (f'{{"messages": {user}, "temperature": NaN}}', "temperature", "must be a number"),
        (f'{{"messages": {user}, "top_p": NaN}}', "top_p", "must be a number"),
        (f'{{"messages": {user}, "temperature": Infinity}}', "temperature", "must be a number"),
        (f'{{"messages": {user}, "seed": {2**64}}}', "seed", "64-bit integer"),
        ('{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages[0].content", "unpaired UTF-16 surrogate"),
        ('{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}', "messages[0].content",
         "unpaired UTF-16 surrogate"),
        ('{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}", None, "nests arrays or objects too deeply"),
        (f'{{"messages": {user}, "frequency_penalty": 0.5}}', "frequency_penalty", "'frequency_penalty' is not supported"),
        (f'{{"messages": {user}, "logprobs": true}}', "logprobs", "send false"),
        (f'{{"messages": {user}, "logit_bias": {{"5": 10}}}}', "logit_bias", "send {}"),
    ]
    for body, param, message in cases:
        status, _, got = raw(server, "POST", "/v1/chat/completions", body.encode())
        assert status == 400, body[:80]
        assert got["error"]["type"] == "invalid_request_error" and got["error"]["param"] == param
        assert message in got["error"]["message"], got
    # the same fields at OpenAI's defaults (what many clients send) are accepted
    status, _, got = raw(server, "POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "seed": 2**64 - 1,
        "frequency_penalty": 0, "presence_penalty": 0.0, "logprobs": False, "logit_bias": {}})
    assert status == 200 and got["usage"]["completion_tokens"] == 1


def test_a_body_over_the_limit_gets_413_before_it_is_read_whole(server):
    limit = body_limit(server.api.engine.config.max_seq_len)
    assert server.api.max_body == limit
    big = json.dumps({"messages": [{"role": "user", "content": "ab " * (limit // 3)}]}).encode()
    status, _, got = raw(server, "POST", "/v1/chat/completions", big)  # with its Content-Length
    assert status == 413 and got["error"]["code"] == "request_too_large"
    assert f"over {limit:,} bytes" in got["error"]["message"]

    def chunks():  # no Content-Length: chunked, counted as it arrives
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(limit // 65536 + 2):
            yield b"x" * 65536
        yield b'"}]}'

    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/chat/completions", body=chunks(), encode_chunked=True,
                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    resp = conn.getresponse()
    got = json.loads(resp.read())
    conn.close()
    assert resp.status == 413 and got["error"]["code"] == "request_too_large"


def test_model_by_id_and_405_allow_header(server, client):
    assert client.models.retrieve("demo").id == "demo"
    status, _, got = raw(server, "GET", "/v1/models/other")
    assert status == 404 and got["error"]["code"] == "model_not_found" and "'demo'" in got["error"]["message"]
    status, headers, got = raw(server, "DELETE", "/v1/models")
    assert status == 405 and got["error"]["code"] == "method_not_allowed"
    assert sorted(headers["allow"].split(", ")) == ["GET", "HEAD"]  # Starlette lists a set: any order


def test_the_servers_system_prompt_goes_to_requests_without_one(engine, server, client):
    app = build_app(engine, ServerConfig(api_key=KEY, defaults=DEFAULTS, system="You are a pirate."))
    msgs = [{"role": "user", "content": "Ahoy?"}]
    with LiveServer(app) as pirate:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{pirate.port}/v1", api_key=KEY, max_retries=0, timeout=60)
        implicit = c.chat.completions.create(model="demo", messages=msgs, max_tokens=1, seed=3)
        other = c.chat.completions.create(model="demo", messages=[{"role": "system", "content": "Be brief."}] + msgs,
                                          max_tokens=1, seed=3)
        c.close()
    explicit = client.chat.completions.create(
        model="demo", messages=[{"role": "system", "content": "You are a pirate."}] + msgs, max_tokens=1, seed=3)
    plain = client.chat.completions.create(model="demo", messages=msgs, max_tokens=1, seed=3)
    assert implicit.usage.prompt_tokens == explicit.usage.prompt_tokens > plain.usage.prompt_tokens
    assert implicit.choices[0].message.content == explicit.choices[0].message.content
    assert other.usage.prompt_tokens < explicit.usage.prompt_tokens  # a request's own system prompt wins


def test_a_job_cancelled_while_it_waits_still_gets_its_ending():
    worker = Worker(engine=None, pool=None, max_queue=2)  # the skipped job never reaches either
    got, done = [], threading.Event()
    job = Job(ChatRequest(None, (), "hi", SamplingParams()), lambda item: (got.append(item), done.set()))
    job.cancel.set()  # the client left before the worker took it
    assert worker.submit(job)
    worker.start()
    assert done.wait(10)
    worker.stop()
    assert len(got) == 1 and isinstance(got[0], Failed) and got[0].status == 503
    assert worker.stats()["cancelled"] == 1 and worker.stats()["queued"] == 0


def test_shutdown_ends_the_running_stream_and_fails_the_waiting_requests(engine):
    app = build_app(engine, ServerConfig(api_key=KEY, max_queue=2, keepalive_s=0.05, defaults=DEFAULTS))
    live = LiveServer(app).__enter__()
    try:
        running_conn, running = open_stream(live, {"messages": [{"role": "user", "content": "Go on."}],
                                                   "max_tokens": 3000})
        running_lines = sse_lines(running)
        next(line for line in running_lines if '"content": "' in line and '"content": ""' not in line)
        waiting_conn, waiting = open_stream(live, {"messages": [{"role": "user", "content": "Wait."}], "max_tokens": 2})
        assert next(sse_lines(waiting)) == ": keep-alive"
        plain = {}
        asker = threading.Thread(target=lambda: plain.update(out=raw(live, "POST", "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "Also waiting."}], "max_tokens": 2})), name="test-waiting-plain")
        asker.start()
        while app.state.api.worker.stats()["queued"] < 2:
            time.sleep(0.01)
        live.server.should_exit = True  # what Ctrl+C or SIGTERM does
        rest = list(running_lines)
        finish = [json.loads(line[6:])["choices"][0]["finish_reason"] for line in rest if line.startswith("data: {")]
        assert finish[-1] == "cancelled" and rest[-1] == "data: [DONE]"
        waited = [line for line in sse_lines(waiting) if line != ": keep-alive"]
        assert "shutting down" in json.loads(waited[0][6:])["error"]["message"] and waited[-1] == "data: [DONE]"
        asker.join(30)
        status, _, body = plain["out"]
        assert status == 503 and body["error"]["code"] is None and "shutting down" in body["error"]["message"]
        running_conn.close()
        waiting_conn.close()
    finally:
        live.__exit__(None, None, None)
    assert not app.state.api.worker.alive

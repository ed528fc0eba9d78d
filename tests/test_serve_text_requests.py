"""What the text server (composer/serve/text.py, composer/serve/text_requests.py) takes from a request, on the
embedded tiny-dllm (a 64-token context): bodies and prompts bounded by the model's context before
anything runs, and a refused request holds no one; OpenAI's ranges, roles and model names; errors of a stream before
it starts with their real status; token-id prompts as lm-evaluation-harness sends them."""

from __future__ import annotations

import json
import socket
import threading
from concurrent.futures import Future

import pytest

pytest.importorskip("fastapi", reason="composer serve needs the serve extra (fastapi, uvicorn)")
pytest.importorskip("uvicorn", reason="composer serve needs the serve extra (fastapi, uvicorn)")
openai = pytest.importorskip("openai", reason="the OpenAI SDK is the client these tests drive")
from serve_support import Server  # noqa: E402

import composer.serve.text as text_server  # noqa: E402
from composer import TextGenerator  # noqa: E402
from composer.serve.app import ServeConfig  # noqa: E402
from composer.serve.text import create_text_app  # noqa: E402
from composer.serve.text_requests import MIN_BODY_BYTES  # noqa: E402

PROMPT = "1 2 + 3 4 ="  # tiny-dllm's words: digits, +, = (space separated)


@pytest.fixture(scope="module")
def gen():
    return TextGenerator.from_pretrained(None, progress=False)  # the embedded tiny-dllm


@pytest.fixture(scope="module")
def server(gen, tmp_path_factory):
    srv = Server(lambda: gen, ServeConfig(output_dir=tmp_path_factory.mktemp("serve")), factory=create_text_app)
    srv.wait_ready()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def forwards(gen) -> int:
    return gen.pipeline.batcher.stats.calls


def running(server) -> int:
    metrics = server.request("GET", "/metrics").body.decode()
    return int(next(line.split()[1] for line in metrics.splitlines()
                    if line.startswith("composer_text_requests_running ")))


def test_an_oversized_body_is_a_413_naming_the_limit_before_it_is_read(server):
    # a 2 MB prompt, announced by Content-Length: refused from the headers, none of the body sent
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 2000020\r\n\r\n")
        answer = b""
        while b"}}" not in answer and (chunk := sock.recv(65536)):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 413")
    assert f"at most {MIN_BODY_BYTES}".encode() in answer  # tiny-dllm's 64 tokens leave the 1 MiB floor


def test_a_prompt_past_the_context_is_a_400_naming_it_and_runs_nothing(server, gen, model):
    plain = {"model": model, "use_chat_template": False}  # the prompts' own tokens (tiny-dllm's template pads sums)
    before = forwards(gen)
    reply = server.request("POST", "/v1/completions", {**plain, "prompt": "1 " * 100, "max_tokens": 8})
    assert reply.status == 400 and reply.json["error"]["param"] == "prompt"
    assert "100 tokens" in reply.json["error"]["message"] and "context of 64" in reply.json["error"]["message"]
    reply = server.request("POST", "/v1/completions", {**plain, "prompt": PROMPT, "max_tokens": 60})
    assert reply.status == 400 and reply.json["error"]["param"] == "prompt"  # as OpenAI names a context overrun
    assert "at most 58" in reply.json["error"]["message"]  # 64 - the prompt's 6 tokens
    assert forwards(gen) == before and running(server) == 0
    ok = server.request("POST", "/v1/completions", {**plain, "prompt": PROMPT, "max_tokens": 58})
    assert ok.status == 200 and ok.json["usage"]["prompt_tokens"] == 6
    # without max_tokens, the folder's gen_length (8) is lowered to what the context leaves (4 after 60 tokens)
    ok = server.request("POST", "/v1/completions", {**plain, "prompt": "1 " * 60})
    assert ok.status == 200 and ok.json["usage"]["completion_tokens"] <= 4


def test_a_huge_request_held_in_its_checks_does_not_stall_a_good_one(server, gen, model, monkeypatch):
    # the huge request is held inside its token check (by events, not by timing): a good request sent meanwhile
    # runs to its answer, so checking holds neither the event loop nor anything generation needs
    entered, release = threading.Event(), threading.Event()
    real_fit = text_server.fit

    def held_fit(generator, request):
        if len(request.prompts[0]) > 1000:
            entered.set()
            assert release.wait(60)
        return real_fit(generator, request)

    monkeypatch.setattr(text_server, "fit", held_fit)
    huge: dict = {}
    thread = threading.Thread(target=lambda: huge.update(reply=server.request(
        "POST", "/v1/completions", {"model": model, "prompt": "1 " * 200_000, "max_tokens": 8})))
    thread.start()
    try:
        assert entered.wait(30)
        good = server.request("POST", "/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 8,
                                                          "seed": 0})
        assert good.status == 200 and good.json["choices"][0]["text"] == gen.generate_text(
            PROMPT, gen_length=8, seed=0).text
        assert not huge  # still held
    finally:
        release.set()
        thread.join(60)
    assert huge["reply"].status == 400 and "200000 tokens" in huge["reply"].json["error"]["message"]
    assert running(server) == 0


class HeldText:
    """The real generator, except that a request for GATED waits, watching its cancel token, until it is cancelled
    (then raises Cancelled, as the pipeline does before its next forward)."""

    def __init__(self, generator):
        self._generator = generator
        self.entered, self.cancelled = threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self._generator, name)

    def submit_text(self, prompt=None, *, cancel=None, **kwargs):
        if prompt != GATED:
            return self._generator.submit_text(prompt, cancel=cancel, **kwargs)
        future = Future()

        def hold() -> None:
            self.entered.set()
            while not cancel.cancelled:
                assert not self.cancelled.wait(0.01)
            self.cancelled.set()
            try:
                cancel.check()
            except Exception as exc:  # noqa: BLE001 - the request's error, as the pipeline's
                future.set_exception(exc)

        threading.Thread(target=hold, daemon=True).start()
        return future


GATED = "9 9 9 ="


def test_a_request_whose_client_leaves_is_cancelled(gen, tmp_path_factory):
    held = HeldText(gen)
    srv = Server(lambda: held, ServeConfig(output_dir=tmp_path_factory.mktemp("serve")), factory=create_text_app)
    try:
        srv.wait_ready()
        body = json.dumps({"prompt": GATED, "max_tokens": 8}).encode()
        with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            assert held.entered.wait(30)
        assert held.cancelled.wait(30)  # the client closed its connection: the request was stopped
        assert srv.request("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 8}).status == 200
    finally:
        srv.stop()


@pytest.mark.parametrize("field, value", [
    ("n", 0), ("n", 17), ("n", 1.5), ("max_tokens", 0), ("max_tokens", -1), ("max_tokens", 2.5),
    ("max_tokens", True), ("temperature", -1), ("temperature", 2.5), ("temperature", float("nan")),
    ("temperature", "hot"), ("top_p", 0), ("top_p", 1.5), ("seed", 2**70), ("seed", "1"), ("stream", "yes"),
    ("stop", ["a"] * 17), ("stop", [""]),
])
def test_openai_fields_out_of_their_range_are_a_400_naming_them(server, model, field, value):
    reply = server.request("POST", "/v1/completions", raw=json.dumps(
        {"model": model, "prompt": PROMPT, field: value}).encode())  # (json writes nan as NaN, as JS clients may)
    assert reply.status == 400 and reply.json["error"]["param"] == field, reply.body


def test_n_gives_n_choices_per_prompt_in_openais_order(server, gen, model):
    reply = server.request("POST", "/v1/completions", {"model": model, "prompt": [PROMPT, "5 6 ="], "n": 2,
                                                       "max_tokens": 8, "seed": 1})
    expected = gen.generate_text([PROMPT, PROMPT, "5 6 =", "5 6 ="], gen_length=8, seed=1)
    assert [c["text"] for c in reply.json["choices"]] == [r.text for r in expected]
    assert [c["index"] for c in reply.json["choices"]] == [0, 1, 2, 3]


def test_another_models_name_is_a_404_model_not_found(client, server, gen, model):
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="gpt-4o", prompt=PROMPT, max_tokens=8)
    assert caught.value.code == "model_not_found" and model in caught.value.message
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": PROMPT}], stream=True)
    for name in (model, gen.family, "tiny-dllm"):  # /v1/models' id, the family, the folder's name
        assert client.completions.create(model=name, prompt=PROMPT, max_tokens=8).choices[0].finish_reason
        assert client.models.retrieve(name).id == model
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    reply = server.request("POST", "/v1/completions", {"model": 5, "prompt": PROMPT})
    assert reply.status == 400 and reply.json["error"]["param"] == "model"


@pytest.mark.parametrize("messages, says", [
    ([{"role": "wizard", "content": "hi"}], "system, developer, user, assistant"),
    ([{"role": "tool", "content": "42", "tool_call_id": "x"}], "tool"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "'image_url' part"),
    ([], "non-empty"),
])
def test_chat_messages_with_unknown_roles_or_parts_are_refused(server, model, messages, says):
    reply = server.request("POST", "/v1/chat/completions", {"model": model, "messages": messages})
    assert reply.status == 400 and reply.json["error"]["param"] == "messages" and says in reply.body.decode()


def test_a_field_of_the_other_endpoint_is_refused(server, model):
    reply = server.request("POST", "/v1/chat/completions", {"model": model, "prompt": PROMPT,
                                                            "messages": [{"role": "user", "content": "x"}]})
    assert reply.status == 400 and reply.json["error"]["param"] == "prompt"
    reply = server.request("POST", "/v1/completions", {"model": model, "prompt": PROMPT,
                                                       "max_completion_tokens": 8})
    assert reply.status == 400 and reply.json["error"]["param"] == "max_completion_tokens"


def test_errors_known_before_a_stream_starts_have_their_status(client, server, model):
    # a 400, streamed or not (not a 200 and an error event, which the SDK raises as a bare APIError)
    with pytest.raises(openai.BadRequestError, match="context"):
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "1 " * 100}], stream=True)
    with pytest.raises(openai.BadRequestError, match="role"):
        client.chat.completions.create(model=model, messages=[{"role": "wizard", "content": PROMPT}], stream=True)
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model=model, prompt="1 " * 100, stream=True)
    with pytest.raises(openai.BadRequestError, match="decoding"):
        client.completions.create(model=model, prompt=PROMPT, stream=True, extra_body={"decoding": "turbo"})
    text = "".join(c.choices[0].text for c in client.completions.create(model=model, prompt=PROMPT, max_tokens=8,
                                                                        seed=2, stream=True))
    assert text == client.completions.create(model=model, prompt=PROMPT, max_tokens=8, seed=2).choices[0].text
    assert running(server) == 0


def test_token_id_prompts_as_lm_eval_sends_them(client, server, gen, model):
    ids = gen.pipeline.tokenizer(PROMPT)["input_ids"]
    expected = gen.generate_text(PROMPT, gen_length=8, seed=1234, use_chat_template=False).text  # ids: no template
    # lm-eval's local-completions with a tokenizer: {"prompt": [[ids]], "temperature": 0, "stop", "seed": 1234}
    body = {"model": model, "prompt": [ids], "max_tokens": 8, "temperature": 0, "stop": ["\n\n"], "seed": 1234}
    reply = server.request("POST", "/v1/completions", body)
    assert reply.status == 200 and reply.json["choices"][0]["text"] == expected
    assert reply.json["usage"]["prompt_tokens"] == len(ids)
    assert client.completions.create(model=model, prompt=ids, max_tokens=8, seed=1234).choices[0].text == expected
    two = client.completions.create(model=model, prompt=[ids, ids[:2]], max_tokens=8, seed=1234)
    assert len(two.choices) == 2
    reply = server.request("POST", "/v1/completions", {"model": model, "prompt": [[5, 99]]})
    assert reply.status == 400 and "99" in reply.json["error"]["message"] and "vocabulary" in reply.body.decode()
    reply = server.request("POST", "/v1/completions", {"model": model, "prompt": [[5], "1"]})
    assert reply.status == 400 and reply.json["error"]["param"] == "prompt"
    reply = server.request("POST", "/v1/completions", {"model": model, "prompt": [[5] * 70]})
    assert reply.status == 400 and "70 tokens" in reply.json["error"]["message"]


def test_token_ids_that_do_not_round_trip_through_the_tokenizer_are_refused():
    from composer.serve.requests import RequestProblem
    from composer.serve.text_requests import _check_round_trip

    _check_round_trip([[5, 6, 7]], [[5, 6, 7]])
    with pytest.raises(RequestProblem, match="position 1: 6 sent, 9 made"):
        _check_round_trip([[5, 6, 7]], [[5, 9, 7]])
    with pytest.raises(RequestProblem, match="position 0: 5 sent, 1 made"):  # a BOS the tokenizer adds
        _check_round_trip([[5, 6]], [[1, 5, 6]])

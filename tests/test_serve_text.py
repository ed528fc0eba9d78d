"""`composer serve` on a diffusion language model (composer/serve/text.py): OpenAI's completions and chat
completions, driven by the official `openai` SDK unchanged (plain and streamed), and by plain HTTP: each answer is
generate_text's for the same settings and seed; bad requests get OpenAI-shaped 400s and lose nothing."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi", reason="composer serve needs the serve extra (fastapi, uvicorn)")
pytest.importorskip("uvicorn", reason="composer serve needs the serve extra (fastapi, uvicorn)")
openai = pytest.importorskip("openai", reason="the OpenAI SDK is the client these tests drive")
from serve_support import Server  # noqa: E402

from composer import TextGenerator  # noqa: E402
from composer.serve.app import ServeConfig  # noqa: E402
from composer.serve.text import create_text_app  # noqa: E402
from composer.testing.tiny_llada2 import build_tiny_llada2  # noqa: E402

pytestmark = pytest.mark.slow
MESSAGES = [{"role": "user", "content": "what is two plus two ?"}]
SETTINGS = {"num_inference_steps": 4, "temperature": 1.0}


@pytest.fixture(scope="module")
def gen(tmp_path_factory):
    folder = build_tiny_llada2(tmp_path_factory.mktemp("text") / "tiny-llada2")
    return TextGenerator.from_pretrained(folder, progress=False)


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
    return client.models.list().data[0].id  # the served model's name (another is a 404, as OpenAI answers)


def test_the_sdks_chat_completion_is_generate_texts(client, gen):
    expected = gen.generate_text(messages=MESSAGES, gen_length=16, seed=3, **SETTINGS)
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=16, seed=3, temperature=1.0,
                                           extra_body={"steps": 4})
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == expected.text
    assert reply.choices[0].finish_reason == "length"  # no EOS in 16 tokens: it ran to max_tokens
    assert reply.usage.completion_tokens == 16 and reply.usage.prompt_tokens == expected.prompt_tokens


def test_the_sdks_streamed_chat_completion_adds_up_to_the_same_text(client, gen, model):
    expected = gen.generate_text(messages=MESSAGES, gen_length=24, seed=4, **SETTINGS)
    stream = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=24, seed=4,
                                            temperature=1.0, stream=True, extra_body={"steps": 4})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected.text
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 2  # block by block
    assert chunks[-1].choices[0].finish_reason == "length"


def test_completions_with_n_and_stop(client, gen, model):
    prompt = "the cat is"
    expected = gen.generate_text([prompt, prompt], gen_length=12, seed=5, use_chat_template=False, **SETTINGS)
    reply = client.completions.create(model=model, prompt=prompt, max_tokens=12, seed=5, n=2, temperature=1.0,
                                      extra_body={"steps": 4, "use_chat_template": False})
    assert [c.text for c in reply.choices] == [r.text for r in expected]
    word = expected[0].text.split()[2]
    cut = client.completions.create(model=model, prompt=prompt, max_tokens=12, seed=5, n=2, temperature=1.0,
                                    stop=[word], extra_body={"steps": 4, "use_chat_template": False})
    assert cut.choices[0].text == expected[0].text[: expected[0].text.find(word)]
    assert cut.choices[0].finish_reason == "stop"


def test_bad_requests_get_openai_errors_and_the_server_goes_on(client, server, model):
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        client.chat.completions.create(model=model, messages=MESSAGES, logprobs=True)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=model, messages=MESSAGES, temperature=-1)
    with pytest.raises(openai.BadRequestError, match="decoding"):
        client.chat.completions.create(model=model, messages=MESSAGES, extra_body={"decoding": "magic"})
    reply = server.request("POST", "/v1/completions", {"prompt": 3})
    assert reply.status == 400 and reply.json["error"]["param"] == "prompt"
    reply = server.request("POST", "/v1/chat/completions", raw=b"{not json")
    assert reply.status == 400
    ok = server.request("POST", "/v1/completions", {"prompt": "the sky", "max_tokens": 8, "steps": 2})
    assert ok.status == 200 and ok.json["object"] == "text_completion" and ok.json["usage"]["completion_tokens"] == 8
    metrics = server.request("GET", "/metrics").body.decode()
    assert "composer_text_requests_total" in metrics and "composer_text_forwards_total" in metrics


def test_a_video_model_is_not_served_by_the_text_app_and_vice_versa(server):
    assert server.request("GET", "/health").json["modality"] == "text"
    assert server.request("POST", "/v1/videos", {"prompt": "x"}).status in (404, 405)
    assert json.loads(server.request("GET", "/v1/models").body)["data"][0]["object"] == "model"

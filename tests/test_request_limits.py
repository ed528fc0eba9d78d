"""One source of request limits (issue 47): the size a model's transformer has positions for, known from the
folder's configs before anything loads; a server's caps folded into the same check, so the nearest valid value it
offers is itself valid; text fields of bounded length."""

from __future__ import annotations

import pytest

from composer.request_check import (
    MAX_TEXT_CHARS,
    ModelLimits,
    RequestError,
    check_cli_request,
    check_request,
    text_length_problems,
)


def test_a_size_past_the_transformers_positions_is_refused_before_loading(cli, monkeypatch):
    """shapes-t2v: 8 pixels a token, 1024 RoPE positions per axis: 8192 pixels at most, refused from the configs."""
    from composer.generator import VideoGenerator

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(VideoGenerator, "from_pretrained", no_loading)
    code, _, err = cli("generate", "--model-path", "shapes-t2v", "--prompt", "a cat", "--width", "10000")
    assert code == 1
    assert ("--width 10000: expected a positive multiple of 8 (at most 8192: the transformer's rope_max_seq_len = "
            "1024 positions per axis; nearest valid: 8192)") in err


def test_the_folder_and_the_loaded_pipeline_state_the_same_limits(composer_gen, tiny_wan_dir):
    from composer.generator import resolve_model

    resolved = resolve_model(str(tiny_wan_dir), None)
    config = resolved.configs.pipeline_config().updated_from_folder(resolved.index.extra)
    folder = ModelLimits.from_folder(resolved.index.folder, config)
    loaded = ModelLimits.from_pipeline(composer_gen.pipeline)
    assert folder == loaded and folder.max_size == 1024 * 16


def test_the_python_api_refuses_a_size_past_the_positions_before_any_work(composer_gen):
    with pytest.raises(RequestError, match=r"width = 16400: expected a positive multiple of 16 \(at most 16384"):
        composer_gen.generate_video("a cat", width=16400, height=32, num_frames=5, num_inference_steps=1)


@pytest.mark.parametrize(("value", "cap", "nearest"), [(9999, 1280, 1280), (10000, 1280, 1280), (1290, 1285, 1280),
                                                       (1005, 1280, 1008), (1001, 1280, 1000), (-5, 1280, None)])
def test_the_nearest_valid_size_keeps_every_limit(value, cap, nearest):
    limits = ModelLimits(spatial_multiple=8, temporal_factor=4, max_size=8192).capped("this server's --{flag}",
                                                                                     max_size=cap)
    from composer.configs.wan import WanT2V480PSamplingParam

    sp = WanT2V480PSamplingParam(prompt="a cat", width=value, height=64, num_frames=9)
    with pytest.raises(RequestError) as info:
        check_request(sp, limits)
    (field, _, rule), = info.value.failures
    assert field == "width"
    if nearest is None:
        assert "nearest" not in rule
    else:
        assert rule.endswith(f"nearest valid: {nearest})")
        assert nearest % 8 == 0 and nearest <= cap
    if value > cap:
        assert "at most 1280: this server's --max-size" in rule


def test_the_nearest_valid_length_keeps_the_servers_cap():
    from composer.configs.wan import WanT2V480PSamplingParam

    limits = ModelLimits(spatial_multiple=16, temporal_factor=4).capped("this server's --{flag}", max_frames=33)
    sp = WanT2V480PSamplingParam(prompt="a cat", width=64, height=64, num_frames=1002)
    with pytest.raises(RequestError, match=r"at most 33: this server's --max-frames; nearest valid: 33\)"):
        check_request(sp, limits)


def test_the_server_answers_an_oversized_request_with_a_valid_nearest_size():
    """9999x9999 on a server of --max-size 1280: the nearest valid size is 1280, not 10000."""
    from composer.generator import VideoGenerator
    from composer.serve.requests import RequestProblem, ServerLimits, check_body

    gen = VideoGenerator.from_pretrained("shapes-t2v", progress=False)
    with pytest.raises(RequestProblem) as info:
        check_body({"prompt": "a cat", "size": "9999x9999"}, gen, ServerLimits())
    message = str(info.value)
    assert info.value.field == "height" and "nearest valid: 10000" not in message
    assert "height = 9999: expected a positive multiple of 8 (at most 1280: this server's --max-size; nearest valid: " \
           "1280)" in message
    checked = check_body({"prompt": "a cat", "size": "1280x1280", "num_inference_steps": 1, "num_frames": 5}, gen,
                         ServerLimits())
    assert checked.params["width"] == 1280


def test_check_cli_request_names_the_flag_and_the_limit():
    with pytest.raises(RequestError) as info:
        check_cli_request("shapes-t2v", None, {"prompt": "a cat", "height": "8200"})
    assert info.value.failures == [("--height", "8200", "a positive multiple of 8 (at most 8192: the transformer's "
                                    "rope_max_seq_len = 1024 positions per axis; nearest valid: 8192)")]


# -- text fields: a bounded length everywhere, and a prompt the encoder cuts is said to be cut -----------------------

LONG = " ".join(["a red circle moving left"] * 40)  # 200 tokens and the end token; shapes-t2v reads 24
HUGE = "a" * (MAX_TEXT_CHARS + 1)
SMALL = dict(height=32, width=32, num_frames=5, num_inference_steps=1, seed=0)


@pytest.fixture(scope="module")
def shapes():
    from composer.generator import VideoGenerator

    return VideoGenerator.from_pretrained("shapes-t2v", progress=False)


@pytest.mark.parametrize("field", ["prompt", "negative_prompt"])
def test_a_text_field_past_the_limit_is_refused_by_the_api_naming_it(shapes, field):
    kwargs = {"prompt": "a cat", field: HUGE}
    with pytest.raises(RequestError, match=fr"{field} = 'aaa.*\.\.\. \({MAX_TEXT_CHARS + 1} characters\): expected at "
                                           fr"most {MAX_TEXT_CHARS} characters"):
        shapes.generate_video(**kwargs, **SMALL)


def test_a_list_of_prompts_and_segments_are_held_to_the_same_limit():
    from composer.configs.wan import WanT2V480PSamplingParam

    sp = WanT2V480PSamplingParam(prompt="a cat", negative_prompt=HUGE)
    assert [f for f, _, _ in text_length_problems(sp, [("ok", 2), (HUGE, 1)])] == ["negative_prompt", "segments[1]"]
    body = {"prompt": ["ok", HUGE], "image": HUGE, "seed": 3}  # an upload's base64 is not a text field
    assert [f for f, _, _ in text_length_problems(body, sampling_cls=type(sp))] == ["prompt[1]"]


def test_the_cli_refuses_a_prompt_past_the_limit_before_loading():
    with pytest.raises(RequestError) as info:
        check_cli_request("shapes-t2v", None, {"prompt": HUGE})
    assert info.value.failures[0][0] == "--prompt" and "at most 20000 characters" in info.value.failures[0][2]


def test_the_server_refuses_a_20_mb_prompt_naming_it(shapes):
    from composer.serve.requests import RequestProblem, ServerLimits, check_body

    with pytest.raises(RequestProblem, match="at most 20000 characters") as info:
        check_body({"prompt": "a" * (20 * 2**20)}, shapes, ServerLimits())
    assert info.value.field == "prompt" and info.value.status == 422


def test_a_truncated_prompt_is_a_warning_naming_the_token_counts(shapes, log):
    result = shapes.generate_video(LONG, **SMALL)
    said = "prompt is 200 tokens; the text encoder reads the first 23 (its max_sequence_length): the last 177 are dropped"
    assert f"WARNING {said}" in log.getvalue()
    assert result.warnings == [said]
    assert shapes.generate_video("a red circle", **SMALL).warnings == []


def test_a_batch_says_which_rows_were_cut(shapes):
    results = shapes.generate_video(["a red circle", LONG], **SMALL)
    assert [r.warnings for r in results] == [[], ["prompt is 200 tokens; the text encoder reads the first 23 (its "
                                                  "max_sequence_length): the last 177 are dropped"]]


def test_a_served_job_carries_the_truncation_in_its_json(shapes, tmp_path):
    pytest.importorskip("uvicorn")
    from serve_support import Server

    from composer.serve.app import ServeConfig

    srv = Server(lambda: shapes, ServeConfig(output_dir=tmp_path))
    try:
        srv.wait_ready()
        reply = srv.request("POST", "/v1/videos", {"prompt": LONG, "num_inference_steps": 1, "num_frames": 5,
                                                   "size": "32x32", "negative_prompt": LONG})
        assert reply.status == 200, reply.body
        assert reply.json["warnings"] == [
            "prompt is 200 tokens; the text encoder reads the first 23 (its max_sequence_length): the last 177 are "
            "dropped",
            "negative_prompt is 200 tokens; the text encoder reads the first 23 (its max_sequence_length): the last "
            "177 are dropped"]
        short = srv.request("POST", "/v1/videos", {"prompt": "a red circle", "num_inference_steps": 1,
                                                   "num_frames": 5, "size": "32x32"})
        assert short.json["warnings"] == []
        again = srv.request("GET", f"/v1/videos/{reply.json['id']}")
        assert again.json["warnings"] == reply.json["warnings"]
    finally:
        srv.stop()


@pytest.mark.parametrize("family", ["hunyuanvideo", "hunyuanvideo-1.5"])
def test_the_llm_text_encoders_say_how_many_tokens_they_cut(family):
    """HunyuanVideo's template stage and HunyuanVideo-1.5's chat stage count the prompt inside their template, so
    the tokens said to be dropped are those the encoder's cut at crop + max_length drops."""
    from composer.stages.chat_text_encoding import ChatTextEncodingStage
    from composer.stages.template_text_encoding import TemplateTextEncodingStage

    if family == "hunyuanvideo":
        from composer.configs.hunyuan_video import HunyuanVideoConfig
        from composer.testing.tiny_hunyuan import build_tiny_hunyuan_components

        c, config = build_tiny_hunyuan_components(), HunyuanVideoConfig()
        stage = TemplateTextEncodingStage(c["text_encoder"], c["tokenizer"], c["text_encoder_2"], c["tokenizer_2"],
                                          template=config.prompt_template, max_length=40)
        full = len(stage.tokenizer(stage.template.format(LONG)).input_ids)
    else:
        from composer.configs.hunyuan_video15 import HunyuanVideo15Config
        from composer.testing.tiny_hunyuan15 import build_tiny_hunyuan15_components

        c, config = build_tiny_hunyuan15_components(), HunyuanVideo15Config()
        stage = ChatTextEncodingStage(c["text_encoder"], c["tokenizer"], c["text_encoder_2"], c["tokenizer_2"],
                                      system_message=config.system_message, max_length=40)
        full = len(stage.tokenizer.apply_chat_template(stage._conversation(LONG), add_generation_prompt=True,
                                                       tokenize=True, return_dict=True)["input_ids"][0])
    assert stage.truncation_warnings("prompt", ["a cat"]) == {}
    (message,), = stage.truncation_warnings("prompt", [LONG]).values()
    assert message.endswith(f"the last {full - stage.crop_start - 40} are dropped") and message.startswith("prompt is ")


def test_a_live_streams_job_carries_the_truncation_too(tmp_path):
    pytest.importorskip("websockets")
    import json

    from serve_support import Server
    from websockets.sync.client import connect

    from composer.generator import VideoGenerator
    from composer.serve.app import ServeConfig

    gen = VideoGenerator.from_pretrained("shapes-causal", progress=False)
    srv = Server(lambda: gen, ServeConfig(output_dir=tmp_path))
    try:
        srv.wait_ready()
        with connect(f"ws://127.0.0.1:{srv.port}/v1/streams", open_timeout=30) as ws:
            ws.send(json.dumps({"prompt": LONG, "num_blocks": 1, "guidance_scale": 1.0, "seed": 5}))
            started = json.loads(ws.recv(timeout=60))
            assert started["type"] == "started", started
            job = srv.request("GET", f"/v1/videos/{started['id']}").json
        assert len(job["warnings"]) == 1 and job["warnings"][0].startswith("prompt is 200 tokens; the text encoder "
                                                                            "reads the first")
    finally:
        srv.stop()


def test_a_sessions_next_prompt_and_a_live_switch_are_held_to_the_same_limit():
    from composer.errors import InvalidInputError
    from composer.generator import VideoGenerator
    from composer.serve.requests import RequestProblem
    from composer.serve.stream import _client_message

    gen = VideoGenerator.from_pretrained("shapes-causal", progress=False)
    with gen.open_session(seed=1) as session:
        with pytest.raises(InvalidInputError, match=f"prompt = 'aaa.*: expected at most {MAX_TEXT_CHARS} characters"):
            session.extend(HUGE, 1)
    with pytest.raises(RequestProblem, match=f"expected at most {MAX_TEXT_CHARS} characters"):
        _client_message({"type": "prompt", "prompt": HUGE}, None, None)


class _LockCheckingTokenizer:
    """A tokenizer that records, at every call, whether the calling thread holds its lock (stages.base)."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def __call__(self, *args, **kwargs):
        from composer.stages.base import tokenizer_lock

        self.calls.append(tokenizer_lock(self)._is_owned())
        return self.inner(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_every_tokenizer_call_of_the_text_encoding_holds_the_tokenizers_lock(shapes):
    """A fast tokenizer sets its truncation and padding on the shared object at each call: the length count (no
    truncation) of one request beside another's padded encoding gave a prompt of 6 tokens where 24 were checked
    (six served jobs at once failed). Every call, the length count's and the encoding's, holds the lock."""
    from composer.batch import ForwardBatch

    stage = shapes.pipeline.stage("TextEncodingStage")
    original = stage.tokenizer
    stage.tokenizer = checking = _LockCheckingTokenizer(original)
    stage.__dict__.pop("_tail", None)
    try:
        stage.forward(ForwardBatch(prompt=[LONG + " once more"], negative_prompt=["blurry, once more"],
                                   guidance_scale=5.0))
    finally:
        stage.tokenizer = original
    assert len(checking.calls) >= 3 and all(checking.calls), checking.calls  # counts, then encodings

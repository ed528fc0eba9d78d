"""One source of request limits (issue 47): the size a model's transformer has positions for, known from the
folder's configs before anything loads; a server's caps folded into the same check, so the nearest valid value it
offers is itself valid; text fields of bounded length."""

from __future__ import annotations

import pytest

from composer.request_check import ModelLimits, RequestError, check_cli_request, check_request


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

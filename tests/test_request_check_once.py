"""A request is checked once, at submit (composer.request_check.check_request): through the Python API, through the
server (before the job is queued) and through `composer generate` (before the model loads); what runs after is the
CheckedRequest that check made, never checked again. The stages' input checks are assertions of it."""

from __future__ import annotations

import time

import pytest

import composer.generator as generator_module
import composer.request_check as request_check
from composer.request_check import CheckedRequest, ModelLimits, RequestError, check_request

SMALL = {"height": 32, "width": 48, "num_frames": 5, "num_inference_steps": 1, "seed": 3}


@pytest.fixture()
def checks(monkeypatch):
    """The number of whole request checks made (each of check_request's runs)."""
    made = []
    real = request_check._check_fields

    def counted(*args, **kwargs):
        made.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(request_check, "_check_fields", counted)
    return made


@pytest.fixture(scope="module")
def t2v():
    from composer import VideoGenerator

    return VideoGenerator.from_pretrained("shapes-t2v", progress=False)


def test_the_api_checks_a_request_once(t2v, checks):
    t2v.generate_video("a red circle", **SMALL)
    assert len(checks) == 1
    t2v.submit_video("a red circle", **SMALL).result(timeout=120)
    assert len(checks) == 2


def test_a_checked_request_runs_without_a_second_check(t2v, checks):
    request = check_request(t2v.sampling_param(prompt="a red circle", **SMALL), ModelLimits.from_pipeline(t2v.pipeline))
    assert isinstance(request, CheckedRequest) and len(checks) == 1
    result = t2v.generate_video(request)
    assert len(checks) == 1
    assert result.frames.shape[0] == SMALL["num_frames"]
    assert (result.frames == t2v.generate_video("a red circle", **SMALL).frames).all()  # the same video


def test_a_checked_request_carries_the_whole_request(t2v):
    request = check_request(t2v.sampling_param(prompt="a red circle", **SMALL), ModelLimits.from_pipeline(t2v.pipeline))
    with pytest.raises(TypeError, match="carries the whole request"):
        t2v.generate_video(request, seed=4)
    with pytest.raises(TypeError, match="made by composer.request_check.check_request"):
        CheckedRequest(request.sampling, request.limits)  # no request is checked by hand


def test_a_field_set_after_the_check_is_checked_alone(t2v, checks, tmp_path):
    request = check_request(t2v.sampling_param(prompt="a red circle", **SMALL), ModelLimits.from_pipeline(t2v.pipeline))
    seeded = request.updated(seed=7, output_path=str(tmp_path / "clip.mp4"))
    assert len(checks) == 1 and seeded.sampling.seed == 7
    (tmp_path / "taken.mp4").write_bytes(b"")
    with pytest.raises(RequestError, match=r"output_path = .*taken.mp4.*pass overwrite=True"):
        request.updated(output_path=str(tmp_path / "taken.mp4"))
    with pytest.raises(RequestError, match=r"height = 30: expected a positive multiple of 8"):
        request.updated(height=30)  # another request: checked whole
    assert len(checks) == 2


def test_a_request_checked_against_other_limits_is_checked_for_this_model(t2v, checks):
    sp = t2v.sampling_param(prompt="a red circle", **SMALL)
    loose = check_request(sp, ModelLimits())  # checked for no model in particular
    tight = check_request(sp, ModelLimits.from_pipeline(t2v.pipeline).capped("a cap", max_steps=4))
    assert not loose.holds_for(ModelLimits.from_pipeline(t2v.pipeline))
    assert tight.holds_for(ModelLimits.from_pipeline(t2v.pipeline))  # tighter caps cover the model's
    checks.clear()
    t2v.generate_video(loose)
    assert len(checks) == 1  # once more, for this model
    t2v.generate_video(tight)
    assert len(checks) == 1


def test_a_batch_seed_counts_every_row():
    """Video i has seed + i: the check refuses a seed whose last row is past the largest seed (the stage that
    said so is an assertion now)."""
    from composer.configs.base import SamplingParam

    sp = SamplingParam(prompt=["a", "b"], height=32, width=32, num_frames=5, num_inference_steps=1,
                       seed=2**63 - 1)
    with pytest.raises(RequestError, match=r"seed = 9223372036854775807: expected an integer in \[0, "
                                           r"9223372036854775806\] \(video i of 2 has seed \+ i\)"):
        check_request(sp, ModelLimits())
    check_request(SamplingParam(**{**sp.__dict__, "seed": 2**63 - 2}), ModelLimits())


def test_a_lazy_sources_first_prompt_is_checked_at_submit():
    from composer.configs.base import SamplingParam

    sp = SamplingParam(prompt=" ", height=32, width=32, num_frames=5, num_inference_steps=1)
    with pytest.raises(RequestError, match=r"prompt = ' ': expected a non-empty prompt"):
        check_request(sp, ModelLimits(), iter([(" ", 1)]))


def test_the_server_checks_a_request_once_before_queueing(t2v, checks, tmp_path):
    from serve_support import Server

    from composer.serve.app import ServeConfig

    srv = Server(lambda: t2v, ServeConfig(output_dir=tmp_path / "serve"))
    try:
        srv.wait_ready()
        bad = srv.request("POST", "/v1/videos", {"prompt": "a red circle", **SMALL, "height": 30})
        assert bad.status == 422 and "height = 30" in bad.json["error"]["message"] and not checks[1:]
        checks.clear()
        reply = srv.request("POST", "/v1/videos", {"prompt": "a red circle", **SMALL})
        assert reply.status == 200, reply.body
        assert len(checks) == 1  # before the job was queued
        job = srv.wait(reply.json["id"])
        assert job["status"] == "completed", job
        assert len(checks) == 1  # and not again when it ran
    finally:
        srv.stop()


def test_composer_generate_resolves_and_checks_once(monkeypatch, checks, tmp_path):
    from composer.cli.main import main

    resolved = []
    real = generator_module.resolve_model
    monkeypatch.setattr(generator_module, "resolve_model", lambda *a, **k: resolved.append(a) or real(*a, **k))
    out = tmp_path / "clip.mp4"
    # (--flow-shift as the folder's scheduler states it: a default only the loaded model tells, and a request
    # whose defaults the loaded model changes is checked again, whole: CheckedRequest.updated)
    code = main(["generate", "--model-path", "shapes-t2v", "--prompt", "a red circle", "--height", "32", "--width",
                 "48", "--num-frames", "5", "--steps", "1", "--flow-shift", "3", "--output", str(out),
                 "--no-progress"])
    assert code == 0 and out.is_file()
    assert len(resolved) == 1  # the model, found once: the checks and the loading share it
    assert len(checks) == 1  # before loading; the run takes the request as checked (its drawn seed checked alone)


def test_composer_generate_refuses_a_bad_request_before_loading(monkeypatch, checks, tmp_path, capsys):
    from composer import VideoGenerator
    from composer.cli.main import main

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded for a request the check refuses")

    monkeypatch.setattr(VideoGenerator, "from_pretrained", no_loading)
    start = time.perf_counter()
    code = main(["generate", "--model-path", "shapes-t2v", "--prompt", "a red circle", "--height", "30", "--width",
                 "48", "--num-frames", "5", "--steps", "1", "--output", str(tmp_path / "clip.mp4")])
    elapsed = time.perf_counter() - start
    err = capsys.readouterr().err
    assert code == 1 and "invalid request (nothing was loaded or generated)" in err
    assert "--height 30: expected a positive multiple of 8" in err
    assert elapsed < 1.0, elapsed
    assert len(checks) == 1


def test_composer_generate_checks_a_prompt_file_once_every_row(checks, tmp_path):
    from composer.cli.main import main

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\na blue square\n")
    code = main(["generate", "--model-path", "shapes-t2v", "--prompt-file", str(prompts), "--height", "32", "--width",
                 "48", "--num-frames", "5", "--steps", "1", "--flow-shift", "3", "--output", str(tmp_path / "c.mp4"),
                 "--no-progress"])
    assert code == 0 and (tmp_path / "c-0.mp4").is_file() and (tmp_path / "c-1.mp4").is_file()
    assert len(checks) == 1 and checks[0].prompt == ["a red circle", "a blue square"]  # every row, before loading


def test_a_checked_request_stays_checked_across_processes():
    """Pickled (to worker processes, num_gpus > 1), a checked request is still one: it can be updated and run."""
    import pickle

    from composer.configs.base import SamplingParam

    sp = SamplingParam(prompt="a", height=32, width=32, num_frames=5, num_inference_steps=1, seed=1)
    request = pickle.loads(pickle.dumps(check_request(sp, ModelLimits())))
    assert isinstance(request, CheckedRequest) and request.sampling == sp
    assert request.updated(seed=2).sampling.seed == 2


def test_a_first_last_frame_request_of_one_frame_is_refused_at_submit():
    """The last-frame stage asserted num_frames >= 2; the check at submit says so to the user."""
    import numpy as np

    from composer.configs.wan_i2v import WanI2V480PSamplingParam

    frame = np.zeros((32, 32, 3), dtype=np.uint8)
    sp = WanI2V480PSamplingParam(prompt="a", height=32, width=32, num_frames=1, num_inference_steps=1, image=frame,
                                 last_image=frame)
    with pytest.raises(RequestError, match=r"num_frames = 1: expected at least 2 with last_image"):
        check_request(sp, ModelLimits(temporal_factor=4, takes_last_image=True))

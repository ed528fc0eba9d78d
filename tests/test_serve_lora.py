"""Per-request LoRA in `composer serve`: a request picks among the adapters loaded at start (`lora`) and sets
their scale (`lora_scale`); the served video equals generate_video's with those adapters, and the next request
gets its own choice (the worker switches the adapters between jobs).

A real server on 127.0.0.1 over the embedded shapes model with two adapters loaded (2 steps, 5 frames)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="composer serve needs the serve extra (fastapi, uvicorn)")
pytest.importorskip("uvicorn", reason="composer serve needs the serve extra (fastapi, uvicorn)")
from serve_support import Server
from test_lora import lora_weights, write_lora

from composer.errors import ConfigError
from composer.generator import VideoGenerator
from composer.serve.app import ServeConfig
from composer.serve.requests import LoraOption, RequestProblem, ServerLimits, check_body, select_lora
from composer.video import read_frames

SMALL = {"num_inference_steps": 2, "num_frames": 5, "seed": 11}
PROMPT = "a yellow star spinning"


@pytest.fixture(scope="module")
def lora_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-lora")
    base = VideoGenerator.from_pretrained(None, progress=False)
    model = base.pipeline.modules["transformer"]
    one = write_lora(root / "one.safetensors", "kohya", lora_weights(model, seed=1))
    two = write_lora(root / "two.safetensors", "original", lora_weights(model, seed=2))
    return base, one, two


def reference(base: VideoGenerator, paths, scales, path) -> np.ndarray:
    """generate_video's frames with these adapters, through the same mp4 writer as the server's."""
    if paths:
        base.set_lora(paths, scales)
    else:
        base.unset_lora()
    base.generate_video(PROMPT, output_path=str(path), **SMALL)
    return read_frames(path)


@pytest.mark.slow  # moved to the full tier: the quick tier must stay under 5 minutes
def test_each_request_runs_with_the_adapters_and_scales_it_asks_for(lora_files, tmp_path):
    base, one, two = lora_files
    cases = [  # (request fields, expected "lora" of the record, adapters and scales of the reference)
        ({}, [["one", 1.0], ["two", 0.5]], ([one, two], [1.0, 0.5])),
        ({"lora": "one", "lora_scale": 0.3}, [["one", 0.3]], ([one], [0.3])),
        ({"lora": []}, [], ([], [])),
        ({"lora": ["two", "one"], "lora_scale": [2, 0.25]}, [["two", 2.0], ["one", 0.25]], ([two, one], [2.0, 0.25])),
        ({"lora_scale": 0.7}, [["one", 0.7], ["two", 0.7]], ([one, two], [0.7, 0.7])),
        ({}, [["one", 1.0], ["two", 0.5]], ([one, two], [1.0, 0.5])),  # back to the start adapters
    ]
    expected = [reference(base, *ref, tmp_path / f"ref{i}.mp4") for i, (_, _, ref) in enumerate(cases)]
    base.unset_lora()
    assert not np.array_equal(expected[0], expected[2]) and not np.array_equal(expected[1], expected[2])

    served_gen = VideoGenerator.from_pretrained(None, progress=False, lora_path=[str(one), str(two)],
                                                lora_scale=[1.0, 0.5])
    config = ServeConfig(output_dir=tmp_path / "serve", loras=[LoraOption("one", str(one), 1.0),
                                                               LoraOption("two", str(two), 0.5)])
    srv = Server(lambda: served_gen, config)
    try:
        srv.wait_ready()
        ids = []
        for fields, _, _ in cases:
            reply = srv.request("POST", "/v1/videos", {"prompt": PROMPT, **SMALL, **fields})
            assert reply.status == 200, reply.body
            ids.append(reply.json["id"])
        for i, (job_id, (_, lora, _)) in enumerate(zip(ids, cases)):
            job = srv.wait(job_id)
            assert job["status"] == "completed", job
            assert job["lora"] == lora
            (tmp_path / f"served{i}.mp4").write_bytes(srv.request("GET", f"/v1/videos/{job_id}/content").body)
            np.testing.assert_array_equal(read_frames(tmp_path / f"served{i}.mp4"), expected[i], err_msg=str(lora))
    finally:
        srv.stop()


LOADED = [LoraOption("style", "/x/style.safetensors", 1.0), LoraOption("motion", "/x/motion.safetensors", 0.8)]


@pytest.mark.parametrize("body, field, words", [
    ({"lora": 3}, "lora", "an adapter's name"),
    ({"lora": ["style", 3]}, "lora", "an adapter's name"),
    ({"lora": "other"}, "lora", "loaded adapters: style, motion"),
    ({"lora": ["style", "style"]}, "lora", "named twice"),
    ({"lora": "style", "lora_scale": "high"}, "lora_scale", "finite number"),
    ({"lora": "style", "lora_scale": True}, "lora_scale", "finite number"),
    ({"lora": "style", "lora_scale": 1e9}, "lora_scale", "<= 100"),
    ({"lora": "style", "lora_scale": [0.5, 0.5]}, "lora_scale", "one per selected adapter"),
    ({"lora_scale": [0.5]}, "lora_scale", "one per selected adapter (style, motion)"),
    ({"lora": [], "lora_scale": 0.5}, "lora_scale", "no adapter is selected"),
])
def test_bad_lora_selections_name_the_field(body, field, words):
    with pytest.raises(RequestProblem, match=words.replace("(", r"\(").replace(")", r"\)")) as exc:
        select_lora({"prompt": "x", **body}, LOADED)
    assert exc.value.field == field and exc.value.status == 422


def test_lora_selection_defaults_and_nulls():
    assert select_lora({}, LOADED) == [["style", 1.0], ["motion", 0.8]]
    assert select_lora({"lora": None, "lora_scale": None}, LOADED) == [["style", 1.0], ["motion", 0.8]]
    assert select_lora({"lora": "motion"}, LOADED) == [["motion", 0.8]]  # its start scale
    assert select_lora({"lora": []}, LOADED) == []
    assert select_lora({}, []) == []
    with pytest.raises(RequestProblem, match="none \\(start the server with --lora-path\\)"):
        select_lora({"lora": "style"}, [])


def test_an_offloading_server_keeps_its_start_adapters():
    offloading = SimpleNamespace(pipeline=SimpleNamespace(runtime=SimpleNamespace(offload="disk")))
    assert select_lora({"lora": ["style", "motion"]}, LOADED, offloading) == [["style", 1.0], ["motion", 0.8]]
    with pytest.raises(RequestProblem, match="offload = disk") as exc:
        select_lora({"lora": "style"}, LOADED, offloading)
    assert exc.value.field == "lora"


def test_cli_refuses_two_adapters_with_one_name(tmp_path):
    from composer.cli.serve import lora_options

    assert [o.name for o in lora_options(["a/style.safetensors", "b/motion.safetensors"], [0.5, 1])] == \
        ["style", "motion"]
    with pytest.raises(ConfigError, match="'style' names two files"):
        lora_options(["a/style.safetensors", "b/style.safetensors"], None)


def test_limits_still_apply_with_a_lora(lora_files):
    base = lora_files[0]
    checked = check_body({"prompt": "x", "lora": "style", "lora_scale": 0.5}, base, ServerLimits(), LOADED)
    assert checked.lora == [["style", 0.5]] and "lora" not in checked.params and "lora_scale" not in checked.params
    with pytest.raises(RequestProblem) as exc:
        check_body({"prompt": "x", "lora": "style", "num_inference_steps": 500}, base, ServerLimits(), LOADED)
    assert exc.value.field == "num_inference_steps"

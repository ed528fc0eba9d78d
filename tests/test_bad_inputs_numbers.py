"""Numeric knobs: every float knob must be a finite number in its range (NaN passes every `<` test, so it used to
slip through: `--cache-threshold nan` ran and skipped nothing), and a step-cache sub-option the chosen cache mode
does not use is a WARNING (the README's rule for an ignored setting), not silence and not an error."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from composer.errors import ComposerError, ConfigError
from composer.request_check import ModelLimits, RequestError, check_request
from composer.runtime import RuntimeArgs

SMALL = ["--height", "32", "--width", "32", "--num-frames", "5", "--steps", "1", "--seed", "0"]


class Stop(ComposerError):
    """Raised in place of loading a model: what the test needs happened before."""


@pytest.fixture()
def no_loading(monkeypatch):
    from composer.generator import VideoGenerator

    def stop(*args, **kwargs):
        raise Stop("stopped before loading")

    monkeypatch.setattr(VideoGenerator, "from_pretrained", stop)


# -- runtime options -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, message", [
    (dict(cache="teacache", cache_threshold="nan"), "cache_threshold = nan: expected a finite number >= 0"),
    (dict(cache="dbcache", cache_threshold=float("inf")), "cache_threshold = inf: expected a finite number >= 0"),
    (dict(cache="teacache", cache_threshold=-0.1), "cache_threshold = -0.1: expected a finite number >= 0"),
    (dict(dist_timeout="nan"), "dist_timeout = nan: expected a finite number > 0"),
    (dict(dist_timeout=float("inf")), "dist_timeout = inf: expected a finite number > 0"),
    (dict(dist_timeout=0), "dist_timeout = 0.0: expected a finite number > 0"),
])
def test_float_runtime_options_must_be_finite_and_in_range(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        RuntimeArgs.from_kwargs(device="cpu", **kwargs)


def test_cli_refuses_a_nan_cache_threshold_before_loading(cli, tiny_wan_dir, no_loading):
    code, _, err = cli("generate", "--model-path", tiny_wan_dir, "--prompt", "x", *SMALL, "--cache", "teacache",
                       "--cache-threshold", "nan")
    assert code == 1 and "cache_threshold = nan: expected a finite number >= 0" in err and "Traceback" not in err
    assert "stopped before loading" not in err


# -- sampling fields -----------------------------------------------------------------------------------------
@dataclass
class FamilySampling:
    """A request with a family's own float fields beside the common ones."""

    prompt: str = "x"
    negative_prompt: str | None = None
    height: int = 32
    width: int = 32
    num_frames: int = 5
    num_inference_steps: int = 1
    guidance_scale: float = 5.0
    guidance_scale_2: float | None = None
    true_cfg_scale: float = 1.0
    strength: float = 0.5  # a float field with no range of its own: finite is the rule
    flow_shift: float | None = None
    seed: int | None = 0
    fps: int = 16
    output_path: str | None = None


@pytest.mark.parametrize("field, value, rule", [
    ("guidance_scale", float("nan"), "a finite number >= 0"),
    ("guidance_scale_2", float("inf"), "a finite number >= 0"),
    ("true_cfg_scale", float("nan"), "a finite number >= 0"),
    ("true_cfg_scale", -1.0, "a finite number >= 0"),
    ("strength", float("nan"), "a finite number"),
    ("flow_shift", float("nan"), "a finite number > 0"),
])
def test_float_sampling_fields_must_be_finite_and_in_range(field, value, rule):
    with pytest.raises(RequestError) as info:
        check_request(FamilySampling(**{field: value}), ModelLimits(spatial_multiple=16, temporal_factor=4))
    assert info.value.failures == [(field, repr(value), rule)]


# -- other numeric flags -------------------------------------------------------------------------------------
def test_serve_refuses_a_nan_request_timeout(cli, tiny_wan_dir):
    code, _, err = cli("serve", "--model-path", tiny_wan_dir, "--request-timeout", "nan")
    assert code == 1 and "--request-timeout nan: expected a finite number of seconds >= 0" in err


@pytest.mark.parametrize("flag, value, text", [("--timestep-shift", "nan", "timestep_shift = nan"),
                                               ("--context-noise", "inf", "context_noise = inf")])
def test_convert_refuses_non_finite_settings(cli, tiny_wan_dir, tmp_path, flag, value, text):
    (tmp_path / "sf.pt").write_bytes(b"")
    code, _, err = cli("convert", "self-forcing", "--checkpoint", tmp_path / "sf.pt", "--base", tiny_wan_dir,
                       "--out", tmp_path / "out", flag, value)
    assert code == 1 and text in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


# -- ignored cache sub-options ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, ignored", [
    (dict(cache_threshold=0.3), ["cache_threshold = 0.3 is ignored: it applies to cache = teacache or dbcache, "
                                 "and cache = 'none'"]),
    (dict(cache_warmup_steps=2, cache_max_consecutive=1), ["cache_warmup_steps = 2 is ignored",
                                                           "cache_max_consecutive = 1 is ignored"]),
    (dict(cache="teacache", cache_taylorseer=True, cache_fn_blocks=2, cache_bn_blocks=1, cache_max_cached_steps=3),
     ["cache_taylorseer = True is ignored: it applies to cache = dbcache, and cache = 'teacache'",
      "cache_fn_blocks = 2 is ignored", "cache_bn_blocks = 1 is ignored", "cache_max_cached_steps = 3 is ignored"]),
])
def test_cache_options_the_mode_does_not_use_are_warned_about(kwargs, ignored, log):
    RuntimeArgs.from_kwargs(device="cpu", **kwargs)
    lines = log.getvalue().splitlines()
    assert len(lines) == len(ignored)
    for text in ignored:
        assert any(line.startswith(f"WARNING {text}") for line in lines), (text, lines)


def test_cache_options_the_mode_uses_are_not_warned_about(log):
    RuntimeArgs.from_kwargs(device="cpu", cache="teacache", cache_threshold=0.1, cache_warmup_steps=2)
    RuntimeArgs.from_kwargs(device="cpu", cache="dbcache", cache_threshold=0.1, cache_fn_blocks=2,
                            cache_taylorseer=True, cache_max_consecutive=2)
    assert log.getvalue() == ""


def test_cli_warns_once_about_a_cache_threshold_without_cache(cli, tiny_wan_dir, no_loading, log):
    code, _, err = cli("generate", "--model-path", tiny_wan_dir, "--prompt", "x", *SMALL, "--cache-threshold", "0.3")
    assert "stopped before loading" in err  # the request itself was fine
    assert log.getvalue().count("WARNING cache_threshold = 0.3 is ignored") == 1

"""The three registries: discovery without import, resolution order, clear errors."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass

import pytest

from composer.configs.base import PipelineConfig, SamplingParam
from composer.errors import ConfigError, UnknownModelError
from composer.registry import configs as config_registry
from composer.registry import get_model_class, get_pipeline_class, register_configs, resolve_configs


def test_discovery_finds_entry_classes_without_importing_them():
    code = (
        "import sys\n"
        "from composer.registry import model_entry_points, pipeline_entry_points\n"
        "models, pipes = model_entry_points(), pipeline_entry_points()\n"
        "assert models['WanTransformer3DModel'].module == 'composer.models.wan.transformer', models\n"
        "assert models['WanModel'].class_name == 'WanTransformer3DModel'\n"
        "assert pipes['WanPipeline'].module == 'composer.pipelines.wan', pipes\n"
        "loaded = [m for m in sys.modules if m.startswith(('composer.models.wan', 'composer.pipelines.wan'))]\n"
        "assert not loaded, loaded\n"
        "assert 'torch' not in sys.modules\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_lookup_imports_lazily_and_returns_composer_classes():
    from composer.models.wan.transformer import WanTransformer3DModel
    from composer.pipelines.wan import WanPipeline

    assert get_model_class("WanTransformer3DModel") is WanTransformer3DModel
    assert get_model_class("WanModel") is WanTransformer3DModel
    assert get_pipeline_class("WanPipeline") is WanPipeline


def test_unknown_model_and_pipeline_classes_list_what_is_known():
    with pytest.raises(UnknownModelError, match="no model class for 'FluxTransformer2DModel'.*WanTransformer3DModel"):
        get_model_class("FluxTransformer2DModel")
    with pytest.raises(UnknownModelError, match="'LTXPipeline'.*served: CausalWanPipeline, .*HunyuanVideoPipeline, "
                       ".*WanPipeline"):
        get_pipeline_class("LTXPipeline")


@dataclass
class _ConfigA(PipelineConfig):
    pass


@dataclass
class _ConfigB(PipelineConfig):
    pass


@dataclass
class _ConfigC(PipelineConfig):
    pass


@pytest.fixture()
def isolated_registry():
    """Register test families on top of the built-ins, then restore the registry."""
    config_registry.registered_families()
    saved = list(config_registry._families)
    yield
    config_registry._families[:] = saved


def test_resolution_order_exact_id_then_short_name_then_detector(isolated_registry):
    register_configs(_ConfigC, SamplingParam, [], [lambda path, cls: cls == "MyPipeline"], name="c-detector")
    register_configs(_ConfigA, SamplingParam, ["org-a/My-Model"], name="a")
    register_configs(_ConfigB, SamplingParam, ["org-b/my-model"], name="b")

    # exact hub id wins over an earlier family whose short name also matches
    assert resolve_configs("org-b/my-model", "MyPipeline").family.name == "b"
    assert resolve_configs("org-b/my-model").matched_by == "hub id"
    # short name (case-insensitive, also a local folder's name) wins over a matching detector
    resolved = resolve_configs("/data/models/MY-MODEL", "MyPipeline")
    assert (resolved.family.name, resolved.matched_by) == ("a", "short name")
    # detector on model_index _class_name
    resolved = resolve_configs("/data/models/something-else", "MyPipeline")
    assert (resolved.family.name, resolved.matched_by) == ("c-detector", "detector")
    assert isinstance(resolved.pipeline_config(), _ConfigC)


def test_hf_cache_snapshot_folder_resolves_as_its_hub_id():
    path = "/root/.cache/huggingface/hub/models--Wan-AI--Wan2.1-T2V-1.3B-Diffusers/snapshots/abc123"
    resolved = resolve_configs(path, "WanPipeline")
    assert (resolved.family.name, resolved.matched_by) == ("wan2.1-t2v", "hub id")


def test_builtin_wan_family_defaults():
    resolved = resolve_configs("Wan-AI/Wan2.1-T2V-14B-Diffusers")
    sp = resolved.sampling_param()
    assert (sp.height, sp.width, sp.num_frames, sp.num_inference_steps) == (480, 832, 81, 50)
    assert (sp.guidance_scale, sp.flow_shift, sp.fps) == (5.0, 3.0, 16)
    assert resolved.pipeline_config().text_encoder_max_length == 512
    assert resolve_configs("wan2.1-t2v-1.3b-diffusers").matched_by == "short name"
    assert resolve_configs("/some/folder", "WanPipeline").family.name == "wan2.1-t2v"


def test_model_family_option_names_the_family_outright():
    from composer.configs.causal_wan import CausalWanConfig
    from composer.configs.wan import WanT2VConfig

    # a renamed copy: the name says nothing, the detector would give Wan2.1's 480x832 defaults
    assert resolve_configs("/models/t2v", "WanPipeline", WanT2VConfig).family.name == "wan2.1-t2v"
    for name in ("shapes-t2v", "Shapes-T2V", "composer/shapes-t2v"):
        resolved = resolve_configs("/models/t2v", "WanPipeline", WanT2VConfig, family=name)
        assert (resolved.family.name, resolved.matched_by) == ("shapes-t2v", "model_family option")
        assert resolved.sampling_param().height == 64
    with pytest.raises(UnknownModelError, match="model_family = 'shapes-t3v': no registered family") as info:
        resolve_configs("/models/t2v", "WanPipeline", WanT2VConfig, family="shapes-t3v")
    assert "shapes-t2v" in str(info.value) and "wan2.1-t2v" in str(info.value)
    # a causal folder cannot take a bidirectional family's configs
    with pytest.raises(ConfigError, match="model_family = 'shapes-t2v': that family's ShapesT2VConfig does not fit"):
        resolve_configs("/models/causal", "CausalWanPipeline", CausalWanConfig, family="shapes-t2v")


def test_unknown_family_error_lists_known_families():
    with pytest.raises(UnknownModelError) as info:
        resolve_configs("/models/mystery", "MysteryPipeline")
    message = str(info.value)
    assert "no registered model family matches '/models/mystery'" in message
    assert "MysteryPipeline" in message
    assert "wan2.1-t2v: Wan-AI/Wan2.1-T2V-1.3B-Diffusers, Wan-AI/Wan2.1-T2V-14B-Diffusers" in message


def test_duplicate_hub_id_is_refused(isolated_registry):
    with pytest.raises(ValueError, match="already registered"):
        register_configs(_ConfigA, SamplingParam, ["Wan-AI/Wan2.1-T2V-1.3B-Diffusers"])

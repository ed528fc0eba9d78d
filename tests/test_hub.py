"""Hub ids: resolved from the Hugging Face cache when present; a clear error offline otherwise."""

from __future__ import annotations

import shutil

import pytest

from composer.errors import ModelNotFoundError
from composer.loader.resolve import download_command, looks_like_hub_id, resolve_model_path


def test_hub_id_offline_and_not_cached_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model_path("Wan-AI/Wan2.1-T2V-1.3B-Diffusers")
    message = str(info.value)
    assert "neither a local folder nor in the Hugging Face cache" in message
    assert f"`{download_command('Wan-AI/Wan2.1-T2V-1.3B-Diffusers')}`" in message


@pytest.mark.parametrize(("installed", "command"), [("2.4.0", "hf download"), ("1.0.0rc1", "hf download"),
                                                     ("0.34.0", "hf download"), ("0.33.5", "huggingface-cli download")])
def test_the_download_command_is_the_installed_huggingface_hubs(monkeypatch, installed, command):
    """huggingface_hub 0.34 added the `hf` CLI and 1.0 dropped `huggingface-cli`: the offline error says the one
    the installed version ships."""
    monkeypatch.setattr("importlib.metadata.version", lambda name: installed)
    assert download_command("a/b") == f"{command} a/b"


def test_hub_id_resolves_from_the_cache(monkeypatch, tmp_path, tiny_wan_dir):
    """A snapshot laid out as huggingface_hub writes it (refs/main -> snapshots/<rev>) loads end to end."""
    cache = tmp_path / "hub"
    repo = cache / "models--Wan-AI--Wan2.1-T2V-1.3B-Diffusers"
    revision = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(tiny_wan_dir, repo / "snapshots" / revision)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))

    folder = resolve_model_path("Wan-AI/Wan2.1-T2V-1.3B-Diffusers")
    assert folder == repo / "snapshots" / revision

    from composer import VideoGenerator

    gen = VideoGenerator.from_pretrained("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", progress=False)
    assert gen.family == "wan2.1-t2v"
    assert gen.default_sampling.num_frames == 81  # the released model's defaults, found by hub id


def test_hub_id_shapes():
    assert looks_like_hub_id("Wan-AI/Wan2.1-T2V-1.3B-Diffusers")
    assert not looks_like_hub_id("./models/wan")
    assert not looks_like_hub_id("/abs/path")
    assert not looks_like_hub_id("justaname")

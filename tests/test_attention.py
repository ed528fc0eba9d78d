"""Attention: the backend registry (one module per backend, the one list of names the settings, CLI help and
errors use), fallbacks, and the module's roles (self attention owns the KV cache, cross attention does not)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from composer.errors import ConfigError
from composer.models.attention import Attention, backend_choices, backend_names, resolve_backend
from composer.runtime import RuntimeArgs

BACKENDS_DIR = Path(__file__).parent.parent / "composer" / "models" / "attention" / "backends"


def test_the_registry_is_the_backend_modules_and_the_only_list_of_names(capsys):
    files = sorted(p.stem for p in BACKENDS_DIR.glob("*.py") if not p.name.startswith("_"))
    assert list(backend_names()) == files and {"sdpa", "flash"} <= set(files)
    assert backend_choices() == ("auto", *files)
    with pytest.raises(ConfigError) as info:
        RuntimeArgs.from_kwargs(attention_backend="xformers")
    assert f"expected one of {', '.join(backend_choices())}" in str(info.value)

    from composer.cli.main import main

    with pytest.raises(SystemExit):
        main(["generate", "--help-all"])  # (every flag: --help shows the common ones)
    assert f"(one of: {', '.join(backend_choices())})" in " ".join(capsys.readouterr().out.split())
    assert main(["models"]) == 0
    listed = capsys.readouterr().out
    assert all(f"\n  {name}: " in listed for name in backend_names())  # each with its capabilities
    assert "sdpa: priority 0; devices any, mask, lse" in listed


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="checks the fallback without flash-attn")
def test_a_missing_backend_falls_back_to_sdpa():
    assert resolve_backend("flash").name == "sdpa"
    assert resolve_backend("auto").name == "sdpa"
    with pytest.raises(ValueError, match="unknown attention backend 'xformers'"):
        resolve_backend("xformers")


def test_self_attention_writes_and_reads_its_kv_cache_and_cross_attention_refuses_one():
    from composer.cache import KVCache, KVCacheSpec

    spec = KVCacheSpec(num_layers=1, batch_size=1, num_heads=2, head_dim=8, tokens_per_frame=3, capacity_frames=4)
    cache = KVCache(spec, torch.float32, "cpu")
    attention = Attention(role="self")
    g = torch.Generator().manual_seed(0)
    frames = [torch.randn(1, 3, 2, 8, generator=g) for _ in range(2)]
    outputs = []
    for index, x in enumerate(frames):
        with cache.pass_over(index, 1):
            outputs.append(attention(x, x, x, kv_cache=cache.layer(0)))
    assert cache.end_frame == 2
    both = torch.cat(frames, dim=1)
    expected = Attention(role="self")(frames[1], both, both)  # frame 1 attends to frames 0 and 1
    assert torch.allclose(outputs[1], expected, atol=1e-6)
    with pytest.raises(ValueError, match="only self-attention keeps a KV cache"):
        with cache.pass_over(2, 1):
            Attention(role="cross")(frames[0], frames[0], frames[0], kv_cache=cache.layer(0))
    assert cache.end_frame == 2  # the failed pass left the cache as it was
    with pytest.raises(ValueError, match="role"):
        Attention(role="both")

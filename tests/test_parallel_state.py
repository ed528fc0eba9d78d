"""The parallel layout: rank numbering and groups over the mesh (cfg, ring, ulysses, tp), and degree checks that
refuse bad combinations before any process starts or any model loads (API and CLI)."""

from __future__ import annotations

import multiprocessing

import pytest

from composer.errors import ConfigError
from composer.parallel.state import ParallelLayout, init_parallel, layout_errors
from composer.runtime import RuntimeArgs


def test_ranks_are_numbered_with_tp_fastest_and_groups_cover_the_world():
    layout = ParallelLayout(ulysses=2, ring=2, tp=2, cfg=2)
    assert layout.world_size == 16 and layout.sp == 4
    assert layout.coords(0) == {"cfg": 0, "ring": 0, "ulysses": 0, "tp": 0}
    assert layout.coords(1)["tp"] == 1 and layout.coords(2)["ulysses"] == 1 and layout.coords(4)["ring"] == 1
    assert layout.coords(8)["cfg"] == 1
    assert all(layout.rank_of(layout.coords(r)) == r for r in range(16))
    for name in ("tp", "ulysses", "ring", "cfg", "sp", "model"):
        groups = layout.group_ranks(name)
        assert sorted(r for g in groups for r in g) == list(range(16))  # a partition of the ranks
    assert layout.group_ranks("tp")[0] == [0, 1]  # neighbours
    assert layout.group_ranks("ulysses")[0] == [0, 2]
    # sp groups list part p = ring index x ulysses + ulysses index
    assert layout.group_ranks("sp")[0] == [0, 2, 4, 6]


def test_describe_names_the_modes():
    assert ParallelLayout(ulysses=2, tp=2).describe() == "ulysses 2 x tp 2"
    assert ParallelLayout(cfg=2).describe() == "cfg-parallel"
    assert ParallelLayout().describe() == "one process"


def test_num_gpus_alone_means_ulysses_over_all_of_them():
    runtime = RuntimeArgs.from_kwargs(num_gpus=4, device="cpu")
    assert (runtime.ulysses_degree, runtime.ring_degree, runtime.tp_size) == (4, 1, 1)


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_gpus=3, ulysses_degree=2), "num_gpus = 3 but the parallel degrees multiply to 2"),
    (dict(num_gpus=4, tp_size=2, cfg_parallel=True, ulysses_degree=2), "multiply to 8"),
    (dict(ulysses_degree=0), "ulysses_degree = 0: expected a positive integer"),
    (dict(tp_size=-2), "tp_size = -2"),
    (dict(dist_timeout=0), "dist_timeout"),
    (dict(device="cuda:1", tp_size=2), "puts every one of the 2 ranks on one GPU"),
])
def test_bad_degrees_are_refused_before_any_process_starts(kwargs, message):
    before = multiprocessing.active_children()
    with pytest.raises(ConfigError, match=message):
        RuntimeArgs.from_kwargs(**{"device": "cpu", **kwargs})
    assert multiprocessing.active_children() == before


def test_a_launch_whose_size_differs_from_the_degrees_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    runtime = RuntimeArgs(device="cpu", ulysses_degree=4)
    assert any("WORLD_SIZE" in e and "multiply to 4" in e for e in layout_errors(runtime))


def test_degrees_without_a_launcher_say_how_to_launch(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError, match=r"torchrun --nproc-per-node=2.*num_gpus=2"):
        init_parallel(RuntimeArgs(device="cpu", ring_degree=2))


def test_one_process_needs_no_process_group():
    assert init_parallel(RuntimeArgs(device="cpu")) is None


def test_cli_refuses_bad_degrees_with_one_line_and_exit_1(capsys, tiny_wan_dir):
    from composer.cli.main import main

    code = main(["generate", "--model-path", str(tiny_wan_dir), "--prompt", "x", "--num-gpus", "3",
                 "--ulysses-degree", "2"])
    err = capsys.readouterr().err
    assert code == 1
    assert err.startswith("composer: error:") and "num_gpus = 3" in err and "Traceback" not in err


def test_tp_with_disk_offload_is_refused():
    from composer.accel.hooks import check_combination

    with pytest.raises(ConfigError, match="tp_size > 1 with offload = disk"):
        check_combination(RuntimeArgs(device="cpu", tp_size=2, offload="disk"))

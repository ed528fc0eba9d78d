"""benchmarks/host_profile.py: N streams at once, timed, with a per-thread sampling profile and cProfile of the core."""

import re

from benchmarks import host_profile


def test_host_profile_times_the_streams_and_profiles_the_core_threads(capsys):
    assert host_profile.main(["--n", "2", "--stream-frames", "9", "--repeats", "1", "--sample", "--cprofile"]) == 0
    out = capsys.readouterr().out
    found = re.search(r"2 streams at once \(threads API, OpenMP release on\), (\d+) frames a run: runs ([\d.]+) s", out)
    assert found and int(found.group(1)) == 18 and float(found.group(2)) > 0
    assert "-- cProfile, engine core (the timed runs)" in out and "-- cProfile, side lane" in out
    assert "transformer.py" in out  # the core's thread ran the transformer's calls
    threads = re.findall(r"-- thread (\S+): (\d+) samples", out)
    assert "composer-core" in dict(threads) and "stream threads" in out  # the core's thread and the callers' pool


def test_the_gpu_suite_runs_it_as_its_host_profile_part(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    suite = Path(host_profile.__file__).with_name("gpu_suite.py")
    run = subprocess.run([sys.executable, str(suite), "--tiny", "--only", "host-profile", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_suite.json").read_text())["results"]["host-profile"]
    assert result["status"] == "ok" and "-- cProfile, engine core" in result["report"], result

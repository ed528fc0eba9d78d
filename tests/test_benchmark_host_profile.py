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

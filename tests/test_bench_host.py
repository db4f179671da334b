"""`gdnspec bench host`: the scheduler's walk over a looping call's iterations, timed, with its JSON."""

import json

from bench import host


def test_host_benchmark_times_an_update_that_emits_every_iterations_token(tmp_path):
    out = tmp_path / "host.json"
    results = host.main(["--rows", "3", "--iterations", "5", "--rounds", "2", "--out", str(out)])
    assert json.loads(out.read_text()) == results
    assert results["rows"] == 3 and results["iterations"] == 5
    assert 0 < results["min_ms"] <= results["update_ms"] <= results["max_ms"]

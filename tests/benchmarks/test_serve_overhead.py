"""benchmarks.studies.serve_overhead on the CPU, as it runs: a real server on the stand-in executor, the serving
benchmark's client in its own process, one row per switch interval; bad arguments refused."""

import json

import pytest

from benchmarks.studies import serve_overhead


def test_rows_come_from_a_real_server_and_client(tmp_path, capsys):
    out = tmp_path / "rows.json"
    argv = ["--step-ms", "2", "--concurrency", "4", "--num-prompts", "8", "--output", "6", "--switch-interval-ms", "5",
            "--work", str(tmp_path / "work"), "--out", str(out)]
    assert serve_overhead.main(argv) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["completed"] == 8 and row["failed"] == 0 and row["switch_interval_ms"] == 5
    assert row["tpot_ms"]["median"] >= 2.0        # never faster than the stand-in's steps
    assert "switch interval  5.0 ms: 8 ok, 0 failed" in capsys.readouterr().out


@pytest.mark.parametrize("argv, named", [(["--step-ms", "0"], "--step-ms"), (["--output", "1"], "--output"),
                                         (["--switch-interval-ms", "-1"], "--switch-interval-ms")])
def test_bad_arguments_are_refused(argv, named, capsys):
    with pytest.raises(SystemExit):
        serve_overhead.main(argv)
    assert named in capsys.readouterr().err

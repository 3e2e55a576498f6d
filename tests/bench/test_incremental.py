"""`frugal-kernels bench` writes its files after each section (a run cut short keeps what
finished) under a stem that tells runs of different sections apart."""

import json

import pytest
import torch

from frugal_kernels.bench import dqt as bench_dqt
from frugal_kernels.bench import ops as bench_ops


@pytest.fixture
def tiny_ops(monkeypatch):
    real_sweep = bench_ops.sweep

    def sweep(**kwargs):
        return real_sweep(**{**kwargs, "numels": [1 << 10], "op_names": ["sign_sgd_"],
                             "rounds": 1})

    monkeypatch.setattr(bench_ops, "sweep", sweep)


def test_a_run_stopped_in_a_section_keeps_the_sections_before(tmp_path, tiny_ops, monkeypatch,
                                                              capsys):
    from frugal_kernels.__main__ import main

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt  # as `timeout -s INT` delivers it

    monkeypatch.setattr(bench_dqt, "storage", interrupted)
    # The command's Ctrl-C: one line and the shell's status for SIGINT, no traceback.
    assert main(["bench", "--only", "ops", "dqt", "--quick", "--device", "cpu", "--stem",
                 "cut", "--out", str(tmp_path)]) == 130
    printed = capsys.readouterr()
    assert "bench: ops took" in printed.out
    assert "interrupted" in printed.err and "Traceback" not in printed.err
    result = json.loads((tmp_path / "cut.json").read_text())
    assert [r["op"] for r in result["ops"]] and "dqt" not in result
    assert list(result["section_seconds"]) == ["ops"] and result["complete"] is False
    assert "later sections are missing" in (tmp_path / "cut.md").read_text()
    assert not list(tmp_path.glob("*.part"))


def test_only_runs_get_their_own_files(tmp_path, tiny_ops):
    from frugal_kernels.__main__ import main
    from frugal_kernels.bench import default_stem
    from frugal_kernels.bench.fingerprint import device_id, fingerprint

    assert main(["bench", "--only", "ops", "--quick", "--device", "cpu",
                 "--out", str(tmp_path)]) == 0
    assert main(["bench", "--only", "ops", "--quick", "--device", "cpu", "--stem", "mine",
                 "--out", str(tmp_path)]) == 0
    stem = device_id(fingerprint(torch.device("cpu"))) + "-quick-ops"
    assert default_stem(fingerprint(torch.device("cpu")), True, ["ops"]) == stem
    names = {p.name for p in tmp_path.iterdir() if p.suffix in (".json", ".md")}
    assert names == {f"{stem}.json", f"{stem}.md", "mine.json", "mine.md"}
    result = json.loads((tmp_path / "mine.json").read_text())
    assert result["complete"] is True and list(result["section_seconds"]) == ["ops"]


def test_the_overhead_section_runs_on_a_gpu_only_when_asked(monkeypatch, tmp_path):
    from frugal_kernels import bench
    from frugal_kernels.__main__ import main

    seen = []
    monkeypatch.setattr(bench, "run", lambda **kwargs: seen.append(kwargs["with_overhead"]) or
                        {"fingerprint": {}, "files": []})
    monkeypatch.setattr("frugal_kernels.bench.report.markdown", lambda result: "")
    for argv, expected in ((["bench"], None), (["bench", "--only", "overhead"], True),
                           (["bench", "--only", "ops"], False),
                           (["bench", "--no-overhead"], False)):
        assert main(argv + ["--out", str(tmp_path)]) == 0
        assert seen.pop() is expected
    assert bench.device_defaults(torch.device("cuda")) == {"with_overhead": False,
                                                           "fresh_processes": False}
    assert bench.device_defaults(torch.device("cpu")) == {"with_overhead": True,
                                                          "fresh_processes": True}

"""The fused-loss benchmark section measures what it says."""

import torch

from frugal_kernels.bench import loss


def test_rows_measure_the_unfused_logits_and_the_fused_chunk(monkeypatch):
    # 1024 x 8192 fp32: the unfused loss holds [N, V] logits and their log-softmax, then
    # their gradients (32 MiB each); the fused one chunk (the whole 32 MiB here at most).
    result = loss.run(torch.device("cpu"), shapes=((1024, 16, (8192,)),), rounds=1,
                      fresh_processes=False)
    [row] = result["rows"]
    logits = 1024 * 8192 * 4
    assert row["unfused"]["grad_bytes"] == row["fused"]["grad_bytes"] == (1024 + 8192) * 16 * 4
    assert row["unfused"]["beyond_bytes"] >= 1.5 * logits
    assert row["fused"]["beyond_bytes"] < row["unfused"]["beyond_bytes"]
    assert row["memory_ratio"] == row["fused"]["beyond_bytes"] / row["unfused"]["beyond_bytes"]
    assert len(row["fused"]["seconds"]) == len(row["unfused"]["seconds"]) == 1
    assert row["time_ratio"] == row["fused"]["median_s"] / row["unfused"]["median_s"]
    text = "\n".join(loss.markdown_lines(result))
    assert "| 1024 x 16 x 8192 | float32 |" in text


def test_the_bench_command_runs_the_section(tmp_path, capsys, monkeypatch):
    from frugal_kernels.__main__ import main

    monkeypatch.setattr(loss, "QUICK_SHAPES", ((64, 8, (300,)),))
    monkeypatch.setattr(loss, "_memory_in_fresh_process", loss.measure_memory)
    assert main(["bench", "--only", "loss", "--quick", "--device", "cpu",
                 "--out", str(tmp_path)]) == 0
    assert "| 64 x 8 x 300 | float32 |" in capsys.readouterr().out
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".json", ".md"]

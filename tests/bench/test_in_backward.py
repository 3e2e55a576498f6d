"""The step-memory benchmark (ordinary vs in backward) measures what it says."""

from frugal_kernels.bench import in_backward
from frugal_kernels.bench.report import markdown
from frugal_kernels.model import LlamaConfig, LlamaForCausalLM


def test_rows_hold_the_bytes_each_step_keeps_alive():
    result = in_backward.step_memory("tiny", shapes=((1, 16),), fresh_processes=False)
    model = LlamaForCausalLM(LlamaConfig.from_preset("tiny", max_seq_len=16))
    sizes = [p.numel() * 4 for p in model.parameters()]
    rows = {(r["optimizer"], r["mode"]): r for r in result["rows"]}
    assert set(rows) == {(n, m) for n in in_backward.OPTIMIZERS
                         for m in ("ordinary", "in_backward")}
    for name in in_backward.OPTIMIZERS:
        ordinary, inbwd = rows[(name, "ordinary")], rows[(name, "in_backward")]
        # Every gradient at once, against the largest one alone; the same state.
        assert ordinary["held_parts"]["grads"] == sum(sizes)
        assert inbwd["held_parts"]["grads"] == max(sizes)
        assert inbwd["held_parts"]["state"] == ordinary["held_parts"]["state"]
        assert inbwd["held_bytes"] == ordinary["held_bytes"] - sum(sizes) + max(sizes)
        assert ordinary["held_with_activations_bytes"] >= ordinary["held_bytes"]
        assert inbwd["memory_peak"] >= inbwd["memory_at_start"] > 0
    assert rows[("torch_adamw", "ordinary")]["held_vs_torch_adamw"] == 1.0
    # Each tensor moved from full AdamW into the projected group holds less state.
    state = {name: rows[(name, "in_backward")]["held_parts"]["state"]
             for name in ("frugal_rho0.25", "frugal_rho0.25_embeddings_projected",
                          "frugal_rho0.25_all_projected")}
    assert (state["frugal_rho0.25"] > state["frugal_rho0.25_embeddings_projected"]
            > state["frugal_rho0.25_all_projected"]), state
    [verdict] = result["target"]
    assert verdict["ratio"] == rows[("frugal_rho0.25", "in_backward")]["held_vs_torch_adamw"]
    text = markdown({"fingerprint": {"gpu": "x", "torch": "", "triton": "", "frugal_kernels": ""},
                     "command": "", "in_backward": result})
    assert "### 1 x 16 tokens" in text and "At 1 x 16: FRUGAL rho=0.25 in backward" in text
    assert "target" not in text.lower() and "not met" not in text  # internal, not for users


def test_a_fresh_process_measures_the_same_held_bytes():
    here = in_backward.measure_step("tiny", "frugal_rho0.25", True, batch_size=1, seq_len=16)
    there = in_backward._in_fresh_process(preset="tiny", name="frugal_rho0.25", in_backward=True,
                                          batch_size=1, seq_len=16)
    assert there["held_bytes"] == here["held_bytes"] and there["loss"] == here["loss"]


def test_the_bench_command_runs_the_section(tmp_path, capsys, monkeypatch):
    from frugal_kernels.__main__ import main

    # In this process: the fresh one is tested above, and each costs an import of torch.
    monkeypatch.setattr(in_backward, "_in_fresh_process", in_backward.measure_step)
    assert main(["bench", "--only", "in_backward", "--quick", "--preset", "tiny",
                 "--device", "cpu", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "ordinary vs step in backward (tiny" in printed and "At 1 x 64: FRUGAL rho=0.25 in backward" in printed
    written = sorted(p.name for p in tmp_path.iterdir())
    assert [n.rsplit(".", 1)[1] for n in written] == ["json", "md"]

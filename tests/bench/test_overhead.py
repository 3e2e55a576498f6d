"""The host-overhead benchmark measures what it says (its timings are not asserted)."""

import torch

import frugal_kernels as fk
from frugal_kernels import ops
from frugal_kernels.bench import overhead
from frugal_kernels.bench.report import markdown


def test_tiny_structure_keeps_the_tensors_of_llama_130m():
    model = overhead.tiny_structure("130m")
    names = [n for n, _ in model.named_parameters()]
    # 12 layers of 4 attention, 3 MLP and 2 norm weights; embedding, final norm, head.
    assert len(names) == 12 * 9 + 3
    assert all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters())
    groups = fk.param_groups(model)
    assert [len(g["params"]) for g in groups] == [12 * 2 + 3, 12 * 7]
    assert sum(p.numel() for p in model.parameters()) < 10_000


def test_host_overhead_rows_for_every_optimizer():
    threads = torch.get_num_threads()
    result = overhead.host_overhead("20m", rounds=1)
    assert [r["optimizer"] for r in result["rows"]] == [
        f"frugal_{p}" for p in fk.optim.subspace_choice.PROJECTIONS] + ["adafrugal_blocks",
                                                                 "torch_adamw_swapped"]
    for r in result["rows"]:
        assert r["step_us"] > 0 and r["vs_torch_adamw_fused"] > 0
    assert result["rows"][-1]["change_us"] is None  # a swapped AdamW has no subspace
    assert result["threads"] == 1 and torch.get_num_threads() == threads  # restored
    text = markdown({"fingerprint": {"gpu": "x", "torch": "", "triton": "", "frugal_kernels": ""},
                     "command": "", "overhead": result})
    assert "frugal_svd" in text and "x fused AdamW" in text
    assert "| torch_adamw_swapped |" in text


def test_op_sweep_reports_the_in_place_roofline():
    from frugal_kernels.bench import ops as bench_ops

    rows = bench_ops.sweep(device=torch.device("cpu"), numels=[1 << 12], dtypes=[torch.float32],
                           backends=["torch"], op_names=["sign_sgd_"], rounds=1)
    assert [r["op"] for r in rows] == ["sign_sgd_"]
    r = rows[0]
    assert r["bytes"] == 3 * r["numel"] * 4  # p read and written, g read
    assert abs(r["roofline_fraction"] - r["gbps"] / r["roofline_gbps"]) < 1e-12
    assert abs(r["copy_fraction"] - r["gbps"] / r["copy_gbps"]) < 1e-12


def test_op_sweep_rows_follow_the_capability_table():
    """A backend asked for that cannot run an op here (cuda on CPU tensors; triton
    without the interpreter) gets no row of it, rather than stopping the sweep."""
    from frugal_kernels.bench import ops as bench_ops

    rows = bench_ops.sweep(device=torch.device("cpu"), numels=[1 << 12], dtypes=[torch.float32],
                           backends=["cpu", "cuda", "triton"],
                           op_names=["adamw_int8_", "frugal_step_int8_"], rounds=1)
    for op in ("adamw_int8_", "frugal_step_int8_"):
        want = {"cpu", "triton"} & set(ops.usable_backends("cpu", "frugal::" + op))
        assert {r["backend"] for r in rows if r["op"] == op} == want, op

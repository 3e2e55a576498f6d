"""The argument classes of the binding (python/module.cpp) against the ops layer.

Every op hands its backends one hyper-parameter record (frugal_kernels.ops)
and the cpu / cuda backends pass it to ``_C`` as the struct of the same name:
the two must have the same fields, and the structs must refuse what the
kernels cannot take rather than fill in zeros.
"""

import dataclasses

import pytest
import torch

from frugal_kernels.ops._common import kernel_batch, subset_batch
from frugal_kernels.ops.adamw import AdamWHyper
from frugal_kernels.ops.dqt_update import DqtHyper
from frugal_kernels.ops.frugal_step import FrugalHyper
from frugal_kernels.ops.lowrank_step import LowrankHyper
from frugal_kernels.ops.sign_sgd import SignSgdHyper

from .cases import _C, LIMITS

RECORDS = [AdamWHyper, SignSgdHyper, FrugalHyper, LowrankHyper, DqtHyper]


def kernel_values(record):
    """Distinct valid values for the struct's fields (rule codes for rules)."""
    values = {}
    for i, f in enumerate(dataclasses.fields(record)):
        values[f.name] = {"maximize": True, "state_free": 1, "bits": 3,
                          "rng_step": 2**32 - 1}.get(f.name, 0.25 + i)
    return values


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: r.__name__)
def test_each_record_has_a_struct_with_its_fields(record):
    values = kernel_values(record)
    struct = getattr(_C, record.__name__)(**values)
    assert {name: getattr(struct, name) for name in values} == values
    assert repr(struct).startswith(record.__name__ + "(")


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: r.__name__)
def test_structs_refuse_missing_unknown_and_mistyped_fields(record):
    struct = getattr(_C, record.__name__)
    values = kernel_values(record)
    missing = dict(values)
    missing.pop("lr")
    with pytest.raises(TypeError, match="missing the keyword argument 'lr'"):
        struct(**missing)
    with pytest.raises(TypeError, match="unexpected keyword argument 'momentum'"):
        struct(**values, momentum=0.9)
    with pytest.raises(TypeError, match="lr cannot be"):
        struct(**{**values, "lr": "0.1"})
    if "state_free" in values:
        with pytest.raises(TypeError, match="state_free cannot be 3"):
            struct(**{**values, "state_free": 3})


def test_a_record_becomes_its_struct_with_host_values_and_codes():
    h = FrugalHyper(torch.tensor(0.5), 0.9, 0.999, 1e-8, 0.1, torch.tensor(3.0), "none", 2.0,
                    torch.tensor(8.0), None)
    struct = h.kernel(_C)
    assert (struct.lr, struct.step, struct.state_free, struct.state_free_scale) == (0.5, 3.0, 2,
                                                                                  2.0)
    # GradScaler's tensors as host values; one not given is no scale and no inf.
    assert (struct.grad_scale, struct.found_inf) == (8.0, 0.0)


def test_batches_check_their_lengths():
    p, g = [torch.zeros(3), torch.zeros(4)], [torch.zeros(3), torch.zeros(4)]
    with pytest.raises(ValueError, match="grads: 1 entries for 2 tensors"):
        kernel_batch(_C, p, g[:1])
    with pytest.raises(ValueError, match="exp_avg_sqs: 1 entries for 2 tensors"):
        kernel_batch(_C, p, g, p, p[:1])
    with pytest.raises(ValueError, match="unknown dtype code 7"):
        _C.TensorBatch(dtype=7, numel=[3], params=[0], grads=[0])
    with pytest.raises(ValueError, match="unknown subset kind code 2"):
        _C.SubsetBatch(kind=2, index_is_int32=True, indices=[0], rows=[1], cols=[1], k=[0])
    hyper = _C.AdamWHyper(lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1.0,
                          maximize=False, grad_scale=1.0, found_inf=0.0)
    with pytest.raises(ValueError, match="exp_avgs: 0 entries for 2 tensors"):
        _C.adamw_cpu(kernel_batch(_C, p, g), hyper, 1)
    idx = [torch.arange(2)]
    subsets = subset_batch(_C, p[:1], idx, "flat")
    frugal = FrugalHyper(torch.tensor(0.1), 0.9, 0.999, 1e-8, 0.0, torch.tensor(1.0), "sign", 1.0,
                         None, None)
    with pytest.raises(ValueError, match="indices: 1 entries for 2 tensors"):
        _C.frugal_step_cpu(kernel_batch(_C, p, g, p, p), subsets, frugal.kernel(_C), 1)
    assert [t.tolist() for t in p] == [[0.0] * 3, [0.0] * 4]


def test_cuda_limits_describe_every_kernel():
    assert set(LIMITS) == {"adamw", "adamw_int8", "sign_sgd", "frugal_step", "frugal_step_int8",
                           "dqt_update", "grad_norm"}
    for op, limits in LIMITS.items():
        assert limits["max_tensors"] <= 256 and limits["max_blocks"] > 0, op
        # The kernels on 8-bit moments count their chunks in moment blocks, one per warp
        # and round; the others in elements, kIlp per thread and round.
        per_round = limits["threads"] // 32 if op.endswith("_int8") else limits["threads"]
        assert limits["chunk"] % per_round == 0, op
    for op in ("frugal_step", "dqt_update"):
        assert LIMITS[op]["chunk"] % LIMITS[op]["tile"] == 0, op
    # dqt_update_'s threads own groups of eight fields (whole bytes of every code width).
    assert LIMITS["dqt_update"]["tile"] == 8 * LIMITS["dqt_update"]["threads"]
    assert "tile" not in LIMITS["adamw"]

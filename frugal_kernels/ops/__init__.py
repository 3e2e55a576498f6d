"""The fused ops, as ``torch.library`` operators with a functional face.

Each op updates lists of tensors in place in one call and runs on one of four
backends (``cpu``, ``cuda``, ``triton``, ``torch``; see DESIGN.md section 3):

- :func:`adamw_` — AdamW with decoupled weight decay;
- :func:`adamw_int8_` — the same on moments stored as 8-bit codes with a scale per
  block of 256 elements (a quarter of the bytes);
- :func:`sign_sgd_` — SignSGD with decoupled weight decay;
- :func:`sgd_` — torch.optim.SGD: momentum, dampening, Nesterov, L2 weight decay;
- :func:`frugal_step_` — the fused FRUGAL update: AdamW on a state-full subset
  of rows, columns or coordinates with compact moments, SignSGD elsewhere;
- :func:`frugal_step_int8_` — the same for rows and columns subsets with the subset's
  moments as 8-bit codes and block scales (as ``adamw_int8_`` stores them);
- :func:`lowrank_step_` — the weight update of FRUGAL's low-rank projections:
  back-projections, the state-free rule on the residual and weight decay;
- :func:`lowrank_adamw_step_` — a whole low-rank FRUGAL step (projection, AdamW
  in the subspace, then lowrank_step_'s update) of many small matrices in one call;
- :func:`dqt_update_` — DQT's step on packed INT-n weights: dequantize, the
  FRUGAL (or AdamW, or SignSGD) update, stochastic rounding, pack;
- :func:`dequantize` — packed INT-n codes back to the float weight (the read
  side of ``nn.QuantLinear``; out of place);
- :func:`quant_matmul` — ``a @ W.T + bias`` (or ``a @ W``) with ``W`` read from its
  packed INT-n codes inside the GEMM (``nn.QuantLinear`` on a GPU; out of place);
- :func:`linear_cross_entropy` — the output layer and the cross-entropy loss without the
  ``[N, V]`` logits in memory, with per-token scores (loss, EL2N, gradient norm) and
  gradients of hidden, weight and bias through autograd (out of place);
- :func:`grad_norm` — the global norm of a list of gradients and their non-finite
  flag in one read (the optimizers' ``clip_grad_norm_`` and skip check; out of place).

The registered operators are ``torch.ops.frugal.<op>``; the functions here
accept Python numbers or tensors for ``lr`` and ``step`` and pick the backend.
"""

from types import SimpleNamespace

from frugal_kernels.ops import (adamw, adamw_int8, dqt_update, frugal_step, frugal_step_int8,
                                lowrank_adamw_step, lowrank_step, sgd, sign_sgd)
from frugal_kernels.ops._dispatch import (BACKENDS, CAPABILITIES, SIZE_LIMITS, implements,
                                         kernel_backend, resolve, usable_backends,
                                         worth_calling)
from frugal_kernels.ops.adamw import adamw_
from frugal_kernels.ops.adamw_int8 import adamw_int8_
from frugal_kernels.ops.dequantize import dequantize
from frugal_kernels.ops.dqt_update import dqt_update_
from frugal_kernels.ops.frugal_step import frugal_step_
from frugal_kernels.ops.frugal_step_int8 import frugal_step_int8_
from frugal_kernels.ops.grad_norm import grad_norm
from frugal_kernels.ops.linear_cross_entropy import linear_cross_entropy
from frugal_kernels.ops.lowrank_adamw_step import lowrank_adamw_step_
from frugal_kernels.ops.lowrank_step import lowrank_step_
from frugal_kernels.ops.quant_matmul import quant_matmul
from frugal_kernels.ops.sgd import sgd_
from frugal_kernels.ops.sign_sgd import sign_sgd_

# Every in-place op's declaration (frugal_kernels.ops._spec), by name.
SPECS = {m.SPEC.name: m.SPEC for m in (adamw, adamw_int8, sign_sgd, sgd, frugal_step,
                                       frugal_step_int8, lowrank_step, lowrank_adamw_step,
                                       dqt_update)}

# What the optimizers' plans call once a bucket's call was checked: each op's body
# without its metadata checks and torch.library's dispatch (``unchecked.<op>``), and
# its prepared call over fixed tensors (``unchecked.prepare_<op>``, for the ops whose
# backends gather their fixed tensors once, the calls whose only new tensors at each step
# are the gradients). Not for torch.compile (its graphs call the registered ops) and not
# for users: a mismatched call here is undefined, where the public ops raise.
unchecked = SimpleNamespace(**{name: spec.unchecked for name, spec in SPECS.items()},
                            **{f"prepare_{name}": spec.prepare for name, spec in SPECS.items()
                               if spec.prepares})

__all__ = ["adamw_", "adamw_int8_", "sign_sgd_", "sgd_", "frugal_step_", "frugal_step_int8_", "lowrank_step_", "lowrank_adamw_step_",
           "dqt_update_", "dequantize", "quant_matmul", "grad_norm", "linear_cross_entropy",
           "BACKENDS", "CAPABILITIES", "SPECS", "unchecked",
           "SIZE_LIMITS", "implements", "kernel_backend", "resolve", "usable_backends",
           "worth_calling"]

"""Triton kernels of the fused ops, one file per op: ``adamw``, ``adamw_int8``,
``sign_sgd``, ``sgd``, ``frugal_step``, ``frugal_step_int8``, ``lowrank_step``, ``dqt_update``.

Each file holds the kernel and the host function that packs its launch table
(``_common``) and launches it once per call for the whole list of tensors;
``lowrank_step``, whose GEMMs dominate, launches once per tensor. The
kernels run on CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1``
(the tests). Their arithmetic follows csrc/include/frugal/update_rules.h
operation by operation, so fp32 results equal the C++ backend's bit for bit
(for ``lowrank_step``, wherever the back-projections are the same: GEMMs that
sum in another order round differently; for ``dqt_update``, the codes too, drawn
from the counter-based generator of csrc/include/frugal/quant.h in uint32 arithmetic).
"""

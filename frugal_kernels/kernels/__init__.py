"""Kernels written in Python: the ``triton`` backend of every op (DESIGN.md section 3).

The C++ and CUDA kernels live in csrc/ and load as ``frugal_kernels._C``.
"""

"""CPU time per call of the int8-state ops beside the fp32-state ones (bench/results/frugal-step-int8-cpu.md).

`python - ROUNDS < bench/cpu/int8_cpu_time.py` from a checkout: 1 thread, 4M parameters as
4 tensors of 1024 x 1024 (the op sweep's cases, rho 0.25), each case timed with
`time.thread_time` (the calling thread's CPU time, which other processes on a loaded
machine do not add to), the cases alternated round by round; prints the medians and the
int8 / fp32 speed ratios. Run it from two checkouts in alternating processes to compare
builds.
"""
import statistics
import sys
import time

import torch

from frugal_kernels.bench import ops as B

torch.set_num_threads(1)
dtypes = [torch.float32, torch.bfloat16]
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 15
names = ["adamw_", "adamw_int8_", "frugal_step_", "frugal_step_int8_"]
for dtype in dtypes:
    params = B.param_set(1 << 22, dtype, torch.device("cpu"))
    cases = []
    for n in names:
        for c in B._FACTORIES[n](params, dtype, 0.25):
            if c.variant == "flat":
                continue
            cases.append((f"{c.op}{'/' + c.variant if c.variant else ''}", c.run("cpu")))
    times = {k: [] for k, _ in cases}
    for fn in (f for _, f in cases):
        fn()
    for r in range(rounds):
        for k, fn in cases:
            t0 = time.thread_time(); fn(); times[k].append(time.thread_time() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    for k in med:
        print(f"{str(dtype):15s} {k:28s} {med[k]:7.2f} ms cpu")
    for a, b in (("adamw_int8_", "adamw_"), ("frugal_step_int8_/rows", "frugal_step_/rows"),
                 ("frugal_step_int8_/columns", "frugal_step_/columns")):
        print(f"{str(dtype):15s} speed {a} / {b}: {med[b] / med[a]:.2f}x")

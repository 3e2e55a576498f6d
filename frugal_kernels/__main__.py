"""The ``frugal-kernels`` command (also ``python -m frugal_kernels``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import List, Optional


def _bench(args: argparse.Namespace) -> int:
    from frugal_kernels import bench
    from frugal_kernels.bench.report import markdown

    result = bench.run(device=args.device, quick=args.quick, out=args.out, op_names=args.ops,
                       with_ops=not args.no_ops, with_optimizers=not args.no_optimizers,
                       preset=args.preset, rounds=args.rounds,
                       command="frugal-kernels " + " ".join(sys.argv[1:]))
    print(markdown(result))
    print("wrote " + ", ".join(result["files"]))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="frugal-kernels",
        description="Memory-frugal LLM training: FRUGAL-family optimizers on fused kernels.")
    sub = parser.add_subparsers(dest="command", required=True)

    bench = sub.add_parser(
        "bench", help="time the fused ops and optimizer steps on this machine",
        description="Time every fused op (per backend, dtype and size) against a copy-bandwidth "
                    "baseline and torch.optim.AdamW(fused=True), and whole optimizer steps on a "
                    "LLaMA-shaped parameter set, all measured side by side in one run. Writes "
                    "<out>/<device-id>.json, .md and .png.")
    bench.add_argument("--device", default="auto", help="cpu, cuda or auto (default)")
    bench.add_argument("--quick", action="store_true", help="a short run (under a minute on a CPU)")
    bench.add_argument("--out", type=Path, default=Path("bench/results"),
                       help="folder for the results (default: bench/results)")
    bench.add_argument("--ops", nargs="+", metavar="OP", help="only these ops (e.g. adamw_)")
    bench.add_argument("--no-ops", action="store_true", help="skip the op sweep")
    bench.add_argument("--no-optimizers", action="store_true", help="skip the optimizer steps")
    bench.add_argument("--preset", help="model shape of the optimizer part (default 130m, "
                                        "20m with --quick)")
    bench.add_argument("--rounds", type=int, help="timing rounds per candidate")
    bench.set_defaults(func=_bench)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

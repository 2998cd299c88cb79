"""``python -m benchmarks``: time ``samplers`` side by side with its peers.

The command line alone. Each suite is a module of this package with a ``run()``:
the squashed-Normal head by default (``squashed_normal.py``), the others by their
flag (``--discrete``: ``discrete.py``, ``--composite``: ``composite.py``,
``--beta``: ``beta.py``, ``--autoregressive``: ``autoregressive.py``, ``--flow``:
``flow.py``), one table
(``_SUITES``) mapping each flag to its module. The size flags choose a grid of
``squashed_normal.py``; the other suites take its batch sizes.
"""

import argparse
import sys
from pathlib import Path

from benchmarks import (
    autoregressive,
    bandwidth,
    beta,
    composite,
    discrete,
    flow,
    squashed_normal,
    timing,
)
from benchmarks.squashed_normal import FULL, LARGE, QUICK

# Each suite by its flag (None: the run without one): its module and what it times.
_SUITES = {
    None: (squashed_normal, "the squashed-Normal head"),
    "discrete": (discrete, "the discrete heads"),
    "composite": (composite, "the composite heads"),
    "beta": (beta, "the Beta head"),
    "autoregressive": (autoregressive, "the autoregressive head"),
    "flow": (flow, "the flow head"),
}


def _batches(text):
    try:
        batches = tuple(int(b) for b in text.split(","))
    except ValueError:
        batches = ()
    if not batches or min(batches) < 1:
        raise argparse.ArgumentTypeError(
            f"expected positive batch sizes separated by commas, e.g. 1,4096,1048576, got {text!r}"
        )
    return batches


def _parser():
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", description=__doc__.splitlines()[0]
    )
    sizes = parser.add_mutually_exclusive_group()
    sizes.add_argument("--full", action="store_true", help="the full grid (A in 1, 8, 64)")
    sizes.add_argument(
        "--large",
        action="store_true",
        help="B in 1, 2**12, 2**16, 2**18, 2**20 at A = 8, for accelerators",
    )
    parser.add_argument(
        "--batches", type=_batches, help="batch sizes, e.g. 1,4096,1048576 (replaces the grid's)"
    )
    parser.add_argument(
        "--device",
        help="platform to run on: cpu, gpu, tpu or a platform name (default: JAX's default)",
    )
    parser.add_argument(
        "--bandwidth-tbs",
        type=float,
        help="device memory bandwidth in TB/s: adds the memory-bandwidth floor to the report "
        f"({bandwidth.H200_TBS} for an H200)",
    )
    parser.add_argument("--out", default=Path(__file__).parent / "results", type=Path)
    parser.add_argument("--name", default="results", help="stem of the report's file names")
    for suite, (_, heads) in _SUITES.items():
        if suite is None:
            continue
        parser.add_argument(
            f"--{suite}",
            action="store_true",
            help=f"time {heads} instead (benchmarks/{suite}.py), writing {suite}.md and "
            f"{suite}.json unless --name is given",
        )
    return parser


def main(argv=None):
    parser = _parser()
    args = parser.parse_args(argv)
    grid = FULL if args.full else LARGE if args.large else QUICK
    if args.batches is not None:
        grid = {**grid, "batches": args.batches}
    try:
        device = timing.select_device(args.device)
    except ValueError as error:
        parser.error(str(error))
    command = " ".join(["python -m benchmarks", *(sys.argv[1:] if argv is None else argv)])
    chosen = [suite for suite in _SUITES if suite is not None and getattr(args, suite)]
    if len(chosen) > 1:
        parser.error(f"--{' and --'.join(chosen)} are separate runs; pass one of them")
    suite = chosen[0] if chosen else None
    module, heads = _SUITES[suite]
    if suite is None:  # the whole grid, and the bandwidth floor if asked for
        sizes, options = grid, {"name": args.name, "bandwidth_tbs": args.bandwidth_tbs}
    else:
        if args.bandwidth_tbs is not None:
            parser.error(f"--bandwidth-tbs: there is no bandwidth floor for {heads}; drop it")
        sizes, options = grid["batches"], {"name": suite if args.name == "results" else args.name}
    print(module.run(sizes, args.out, device=device, command=command, **options))


if __name__ == "__main__":
    main()

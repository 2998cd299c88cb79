"""``python -m benchmarks``: time ``samplers`` side by side with its peers.

The command line alone. Each suite is a module of this package with a ``run()``:
the squashed-Normal head by default (``squashed_normal.py``), the others by their
flag (``--discrete``: ``discrete.py``, ``--composite``: ``composite.py``,
``--beta``: ``beta.py``, ``--autoregressive``: ``autoregressive.py``, ``--flow``:
``flow.py``, ``--tokens``: ``tokens.py``, ``--end-to-end``: ``end_to_end.py``), one
table (``_SUITES``) mapping each flag to its module. The size flags choose a grid of
``squashed_normal.py``; the other suites take its batch sizes, but ``--tokens``, whose
``--batches`` are numbers of tokens and whose ``--large`` is its own grid, and
``--end-to-end``, which takes ``--num-envs`` and ``--budget``.
"""

import argparse
import importlib
import sys
from pathlib import Path

from benchmarks import bandwidth, timing
from benchmarks.squashed_normal import FULL, LARGE, QUICK

# Each suite by its flag (None: the run without one): its module and what it times. The
# chosen suite's module alone is imported (the end-to-end suite needs gymnax).
_SUITES = {
    None: ("squashed_normal", "the squashed-Normal head"),
    "discrete": ("discrete", "the discrete heads"),
    "composite": ("composite", "the composite heads"),
    "beta": ("beta", "the Beta head"),
    "autoregressive": ("autoregressive", "the autoregressive head"),
    "flow": ("flow", "the flow head"),
    "tokens": ("tokens", "the token head's training, decode and untruncated steps"),
    "end-to-end": ("end_to_end", "PPO on CartPole and Pendulum, each whole run one compiled call"),
}
_WITH_CASES = ("discrete", "composite", "beta", "flow", "tokens")  # suites of several cases


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
        help="B in 1, 2**12, 2**16, 2**18, 2**20 at A = 8, for accelerators (--tokens: "
        "D = 2048, V = 151936, bfloat16, N = 8192 tokens, R in 256, 1024 rows)",
    )
    parser.add_argument(
        "--batches",
        type=_batches,
        help="batch sizes, e.g. 1,4096,1048576 (replaces the grid's); for --tokens the "
        "numbers of tokens N",
    )
    parser.add_argument(
        "--device",
        help="platform to run on: cpu, gpu, tpu or a platform name (default: JAX's default)",
    )
    parser.add_argument(
        "--rounds", type=int, help="interleaved rounds per cell (default: the suite's)"
    )
    parser.add_argument(
        "--only",
        type=lambda text: tuple(text.split(",")),
        help="names of the implementations to time beside each table's reference, which "
        "is always timed, e.g. 'samplers,samplers (pure layer)' (default: all)",
    )
    parser.add_argument(
        "--cases",
        type=lambda text: tuple(text.split(",")),
        help=f"--{', --'.join(_WITH_CASES)}: time only the cases whose names contain one of "
        "these strings, e.g. 'K = 4,spline', or the whole string where a name holds it, "
        "e.g. 'affine, K = 1' (default: all); the other tables are timed as usual",
    )
    parser.add_argument(
        "--timing",
        choices=("loop", "call"),
        help="time each step inside one compiled loop, beside the floor of a step that only "
        "reads its inputs and writes its outputs (the default on an accelerator), or one "
        "call at a time, its dispatch included (the default on the CPU)",
    )
    parser.add_argument(
        "--bandwidth-tbs",
        type=float,
        help="device memory bandwidth in TB/s: the floor's bytes over it in the loop's "
        "tables (known for a TPU v5e), and for the default suite the modelled "
        f"memory-bandwidth floor ({bandwidth.H200_TBS} for an H200)",
    )
    parser.add_argument("--out", default=Path(__file__).parent / "results", type=Path)
    parser.add_argument("--name", default="results", help="stem of the report's file names")
    parser.add_argument(
        "--num-envs",
        type=int,
        help="--end-to-end: environments side by side (default 2048: end_to_end.NUM_ENVS)",
    )
    parser.add_argument(
        "--budget",
        type=float,
        help="--end-to-end: factor on each run's environment steps (default 1: 3M for "
        "CartPole, 6M for Pendulum)",
    )
    for suite, (_, heads) in _SUITES.items():
        if suite is None:
            continue
        stem = suite.replace("-", "_")
        parser.add_argument(
            f"--{suite}",
            action="store_true",
            help=f"time {heads} instead (benchmarks/{stem}.py), writing {stem}.md and "
            f"{stem}.json unless --name is given",
        )
    return parser


def main(argv=None):
    parser = _parser()
    args = parser.parse_args(argv)
    grid = FULL if args.full else LARGE if args.large else QUICK
    if args.batches is not None:
        grid = {**grid, "batches": args.batches}
    if args.rounds is not None:
        if args.rounds < 1:
            parser.error(f"--rounds must be at least 1, got {args.rounds}")
        grid = {**grid, "rounds": args.rounds}
    try:
        device = timing.select_device(args.device)
    except ValueError as error:
        parser.error(str(error))
    command = " ".join(["python -m benchmarks", *(sys.argv[1:] if argv is None else argv)])
    chosen = [s for s in _SUITES if s is not None and getattr(args, s.replace("-", "_"))]
    if len(chosen) > 1:
        parser.error(f"--{' and --'.join(chosen)} are separate runs; pass one of them")
    suite = chosen[0] if chosen else None
    module_name, heads = _SUITES[suite]
    module = importlib.import_module(f"benchmarks.{module_name}")
    in_loop = args.timing == "loop" or (args.timing is None and device.platform != "cpu")
    if args.bandwidth_tbs is not None and not (in_loop or suite is None):
        parser.error(
            f"--bandwidth-tbs: there is no bandwidth floor for {heads} timed per call; "
            "add --timing loop, or drop it"
        )
    if args.cases is not None and suite not in _WITH_CASES:
        parser.error(f"--cases is an option of --{', --'.join(_WITH_CASES)}; drop it")
    timing.set_timing(
        in_loop=in_loop, bandwidth_tbs=args.bandwidth_tbs, only=args.only, cases=args.cases
    )
    if suite != "end-to-end" and (args.num_envs, args.budget) != (None, None):
        parser.error("--num-envs and --budget are options of --end-to-end; drop them")
    if suite == "tokens" and args.full:
        parser.error("--tokens has no --full grid: pass --large or --batches")
    if suite is None:  # the whole grid, and the modelled bandwidth floor if asked for
        sizes, options = grid, {"name": args.name, "bandwidth_tbs": args.bandwidth_tbs}
    elif suite == "end-to-end":
        sizes = module.NUM_ENVS if args.num_envs is None else args.num_envs
        options = {
            "name": "end_to_end" if args.name == "results" else args.name,
            "budget": 1.0 if args.budget is None else args.budget,
        }
    elif suite == "tokens":  # its own grids: None takes the --large or the default one
        sizes = args.batches
        options = {
            "name": suite if args.name == "results" else args.name,
            "large": args.large,
        }
        if args.rounds is not None:
            options["rounds"] = args.rounds
    else:
        sizes, options = grid["batches"], {"name": suite if args.name == "results" else args.name}
        if args.rounds is not None:
            options["rounds"] = args.rounds
    try:
        report = module.run(sizes, args.out, device=device, command=command, **options)
    except timing.UnknownCases as error:
        parser.error(str(error))
    print(report)


if __name__ == "__main__":
    main()

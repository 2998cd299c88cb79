"""The memory-bandwidth floor: the least time a step can take on a device.

A step that reads each of its inputs from device memory once, writes each of its
outputs once and computes everything else on chip (the noise included: a
counter-based draw reads nothing) moves ``bytes_per_element(workload, A) * B``
bytes, which at the device's bandwidth takes ``floor_seconds``. The model, per
batch element, for an action size ``A`` in float32 (4 bytes a number):

- **rollout**: reads ``mean_and_std`` (2A); writes the action (A), the
  log-likelihood (1) and the pre-image (A): ``4 * (4A + 1)`` bytes.
- **loss**: reads ``mean_and_std`` (2A), the stored pre-image (A), the old
  log-likelihood (1) and the advantage (1); writes the gradient with respect to
  ``mean_and_std`` (2A): ``4 * (5A + 2)`` bytes.
- **actor**: reads ``mean_and_std`` (2A); writes its gradient (2A):
  ``4 * 4A`` bytes.

Keys, scalar losses and the critic's constants are a few bytes per call and are
left out. It is a floor, not a prediction: a step that XLA splits into several
kernels moves intermediates through memory too, and at small batches the launch
and synchronisation latency, not bandwidth, sets the time. ``fraction`` is the
floor over the measured time, the share of the bandwidth a step achieves.

``python -m benchmarks.bandwidth benchmarks/results/gpu.json --bandwidth-tbs 4.8``
prints the table for the times a run of the suite saved.
"""

import argparse
import json
from pathlib import Path

H200_TBS = 4.8  # the H200's HBM3e bandwidth, terabytes per second
_NUMBERS_PER_ELEMENT = {  # (per action, per element), see the module docstring
    "rollout": (4, 1),
    "loss": (5, 2),
    "actor": (4, 0),
}
_SKIPPED = "floor"  # the draw alone is not the workload the floor models


def bytes_per_element(workload: str, actions: int, itemsize: int = 4) -> int:
    """Bytes a step must read and write per batch element (see the module docstring).

    Raises:
        ValueError: ``workload`` is not one the model covers.
    """
    if workload not in _NUMBERS_PER_ELEMENT:
        raise ValueError(
            f"workload must be one of {sorted(_NUMBERS_PER_ELEMENT)}, got {workload!r}."
        )
    per_action, per_element = _NUMBERS_PER_ELEMENT[workload]
    return itemsize * (per_action * actions + per_element)


def floor_seconds(workload: str, batch: int, actions: int, bandwidth_tbs: float) -> float:
    """Seconds to move the step's bytes at ``bandwidth_tbs`` terabytes per second."""
    if not bandwidth_tbs > 0:
        raise ValueError(f"bandwidth_tbs must be positive, got {bandwidth_tbs!r}.")
    return bytes_per_element(workload, actions) * batch / (bandwidth_tbs * 1e12)


def report(records: list[dict], bandwidth_tbs: float = H200_TBS) -> str:
    """Markdown tables: per workload and size, the floor and each step's time and fraction.

    Args:
        records: The suite's saved timings, each a dict with ``workload``,
            ``batch``, ``actions``, ``implementation`` and ``seconds`` (median).
        bandwidth_tbs: The device's memory bandwidth, terabytes per second.
    """
    lines = [
        f"## Memory-bandwidth floor ({bandwidth_tbs:g} TB/s)",
        "",
        "Floor: the bytes a step must read and write once (rollout 4 (4A + 1), loss "
        "4 (5A + 2), actor 16A per element, float32; see `benchmarks/bandwidth.py`) "
        "over the bandwidth. Cell: measured median us per call (floor / measured, "
        "the share of the bandwidth reached).",
    ]
    workloads = list(dict.fromkeys(r["workload"] for r in records))
    for workload in workloads:
        rows = [r for r in records if r["workload"] == workload]
        names = [
            n
            for n in dict.fromkeys(r["implementation"] for r in rows)
            if not n.startswith(_SKIPPED)
        ]
        times = {(r["batch"], r["actions"], r["implementation"]): r["seconds"] for r in rows}
        sizes = list(dict.fromkeys((r["batch"], r["actions"]) for r in rows))
        lines += [
            "",
            f"### {workload.capitalize()} step",
            "",
            "| B | A | bytes | floor (us) | " + " | ".join(names) + " |",
            "|" + "---|" * (len(names) + 4),
        ]
        for batch, actions in sizes:
            floor = floor_seconds(workload, batch, actions, bandwidth_tbs)
            cells = []
            for name in names:
                seconds = times.get((batch, actions, name))
                cells.append(
                    "-"
                    if seconds is None
                    else f"{seconds * 1e6:.1f} ({100 * floor / seconds:.3g}%)"
                )
            size = bytes_per_element(workload, actions) * batch
            lines.append(
                f"| {batch} | {actions} | {_bytes(size)} | {floor * 1e6:.3g} | "
                + " | ".join(cells)
                + " |"
            )
    return "\n".join(lines) + "\n"


def _bytes(size):
    if size < 1024:
        return f"{size} B"
    for unit in ("KiB", "MiB", "GiB"):
        size /= 1024
        if size < 1024 or unit == "GiB":
            return f"{size:.1f} {unit}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="a results .json written by the suite")
    parser.add_argument(
        "--bandwidth-tbs",
        type=float,
        default=H200_TBS,
        help=f"device memory bandwidth in TB/s (default {H200_TBS}, the H200's)",
    )
    parser.add_argument("--out", type=Path, help="also write the tables to this file")
    args = parser.parse_args(argv)
    text = report(json.loads(args.results.read_text())["timings"], args.bandwidth_tbs)
    if args.out is not None:
        args.out.write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()

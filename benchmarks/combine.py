"""``python -m benchmarks.combine``: one report from the JSON of several runs of a suite.

A suite's run on an accelerator may stop at a time limit, or time its batch sizes in
separate runs; this joins their cells into one ``NAME.json`` and ``NAME.md``::

    python -m benchmarks.combine benchmarks/results/tpu-beta a/tpu-beta.json b/tpu-beta.partial.json

A run given as ``PATH:rollout`` (workloads, comma-separated) brings only those
workloads' cells; a joined report given as a run brings its runs and cells.

A cell (workload, case, batch, implementation) timed in more than one run is taken from
the last run given. The Markdown has one table per workload, as the suites write them in
the loop: the reference's time per step, each implementation's ratio to it (min-max
over the rounds), the share of the floor, the floor's time and the bytes it moves over
the bandwidth. Each run's header (command, device, commit) is kept in the JSON's
``runs`` and listed in the Markdown, a stopped run's (its ``NAME.partial.json``) marked
as stopped at its time limit.
"""

import argparse
import json
from pathlib import Path

from benchmarks.timing import FLOOR, table

_KEYS = ("workload", "case", "head", "batch", "implementation")


def combine(paths):
    """The record of the runs in ``paths``: ``{"runs": [headers], "timings": [cells]}``.

    A path may end in ``:WORKLOAD,...`` to take only those workloads' cells from that
    run (its header then lists them); a joined report given as a run brings its own
    runs along.
    """
    runs, cells = [], {}
    for argument in paths:
        path, _, selected = str(argument).partition(":")
        record = json.loads(Path(path).read_text())
        workloads = selected.split(",") if selected else None
        timings = [
            cell for cell in record["timings"] if workloads is None or cell["workload"] in workloads
        ]
        if "runs" in record:
            runs += record["runs"]
        else:
            header = {key: value for key, value in record.items() if key != "timings"}
            batches = sorted({cell["batch"] for cell in timings})
            selection = {} if workloads is None else {"workloads": workloads}
            runs.append({"file": Path(path).name, "batches": batches, **selection, **header})
        for cell in timings:
            cells[tuple(cell.get(key) for key in _KEYS)] = cell
    return {"runs": runs, "timings": list(cells.values())}


def _ratio(cell):
    return f"{cell['ratio']:.2f} ({cell['low']:.2f}-{cell['high']:.2f}); {cell['floor_share']:.0%}"


def markdown(record, title):
    """The report's text: the runs, then a table per workload, rows by case and batch."""
    lines = [
        f"# {title}",
        "",
        "Joined from these runs (a later run's cell replaces an earlier one's):",
        "",
    ]
    for run in record["runs"]:
        command, stopped = run.get("command"), "a run stopped at its time limit"
        if command is None:
            what = f"{stopped}, the cells it had timed"
        else:
            what = f"`{command}`" + (f", {stopped}" if run.get("stopped") else "")
        where = "".join(f", {run[key]}" for key in ("device_kind", "samplers") if key in run)
        only = f" ({', '.join(run['workloads'])} only)" if "workloads" in run else ""
        lines.append(f"- B = {', '.join(map(str, run['batches']))}{only}: {what}{where}")
    timings = record["timings"]
    label = "head" if any("head" in cell for cell in timings) else "case"
    names = list(
        dict.fromkeys(cell["implementation"] for cell in timings if cell["implementation"] != FLOOR)
    )
    header = [
        label,
        "B",
        f"{names[0]}, us per step (share of the floor)",
        *names[1:],
        "floor, us per step",
        "bytes / bandwidth, us",
    ]
    for workload in dict.fromkeys(cell["workload"] for cell in timings):
        rows = {}
        for cell in timings:
            if cell["workload"] == workload:
                rows.setdefault((cell[label], cell["batch"]), {})[cell["implementation"]] = cell
        cases = list(dict.fromkeys(case for case, _ in rows))
        body = []
        for case, batch in sorted(rows, key=lambda key: (cases.index(key[0]), key[1])):
            row = rows[case, batch]
            reference, floor = row.get(names[0]), row.get(FLOOR)
            body.append(
                [
                    case,
                    batch,
                    "-"
                    if reference is None
                    else f"{reference['seconds'] * 1e6:.1f} ({reference['floor_share']:.0%})",
                    *("-" if n not in row else _ratio(row[n]) for n in names[1:]),
                    "-" if floor is None else f"{floor['seconds'] * 1e6:.1f}",
                    "-" if floor is None else f"{floor['bandwidth_seconds'] * 1e6:.1f}",
                ]
            )
        lines += ["", f"## {workload}", "", table(body, header)]
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.combine", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "name", help="the report's path without its suffix, e.g. benchmarks/results/tpu-beta"
    )
    parser.add_argument(
        "runs", nargs="+", help="the runs' JSON files, earliest first (PATH:WORKLOAD,... for some)"
    )
    parser.add_argument("--title", default="Timed in the loop, joined runs")
    args = parser.parse_args(argv)
    record = combine(args.runs)
    Path(f"{args.name}.json").write_text(json.dumps(record, indent=1) + "\n")
    Path(f"{args.name}.md").write_text(markdown(record, args.title))


if __name__ == "__main__":
    main()

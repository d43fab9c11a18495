"""The table and ratios of README.md from calls.log and call-N/results.json (run beside them)."""

import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2] / "bench"))
from tgis_bench.compare.paired import median_interval  # noqa: E402


def rounds() -> list[tuple[int, int, str, float, float, float]]:
    """(call, round, clean or contaminated, before, before-again, after tokens/s) per round."""
    rows = []
    for line in (HERE / "calls.log").read_text().splitlines():
        fields = line.split()
        call, verdict = int(fields[1]), fields[-1]
        samples = json.loads((HERE / f"call-{call}" / "results.json").read_text())["samples"]
        by_round: dict[int, dict[str, float]] = {}
        for s in samples:
            by_round.setdefault(s["round"], {})[s["name"]] = s["tokens_per_second"]
        for number, tps in sorted(by_round.items()):
            rows.append((call, number, verdict, tps["before"], tps["before-again"], tps["after"]))
    return rows


def line(label: str, values: list[float]) -> str:
    low, high, coverage = median_interval(values)
    return (
        f"{label}: n={len(values)} median {statistics.median(values):.3f} "
        f"range {min(values):.3f}-{max(values):.3f} interval {low:.3f}-{high:.3f} ({coverage:.0%})"
    )


def main() -> None:
    rows = rounds()
    header = ["call", "round", "machine", "before", "before-again", "after", "after ÷ before"]
    print("| " + " | ".join([*header, "before-again ÷ before"]) + " |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|")
    for call, number, verdict, before, again, after in rows:
        cells = [call, number + 1, verdict, f"{before:.1f}", f"{again:.1f}", f"{after:.1f}"]
        cells += [f"{after / before:.3f}", f"{again / before:.3f}"]
        print("| " + " | ".join(map(str, cells)) + " |")
    clean = [r for r in rows if r[2] == "clean"]
    for label, chosen in (("clean", clean), ("all", rows)):
        print(line(f"{label}: after/before", [r[5] / r[3] for r in chosen]))
        print(line(f"{label}: before-again/before", [r[4] / r[3] for r in chosen]))
        print(line(f"{label}: after/before-again", [r[5] / r[4] for r in chosen]))
    for index, name in ((3, "before"), (4, "before-again"), (5, "after")):
        print(f"median tok/s, clean: {name} {statistics.median(r[index] for r in clean):.1f}")
    first = [r[3] / statistics.mean((r[4], r[5])) for r in clean if r[1] == 0]
    print(f"clean first rounds, before (first of its call) / the others: {statistics.median(first):.3f}")


if __name__ == "__main__":
    main()

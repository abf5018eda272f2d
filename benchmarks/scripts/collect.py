"""Merge several ``ember bench --json`` files (one suite measured in several runs, e.g. two
halves) into one result file, a speedup plot and a markdown table.

    python benchmarks/scripts/collect.py RUN1.json RUN2.json ... --json OUT.json --plot OUT.png --md OUT.md
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ember.bench import report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--json", required=True)
    parser.add_argument("--plot")
    parser.add_argument("--md")
    args = parser.parse_args()
    runs, results = [], []
    for path in args.runs:
        data = json.loads(Path(path).read_text())
        runs.append({"file": Path(path).name, "env": data["env"], "config": data["config"]})
        results += data["results"]
    Path(args.json).write_text(json.dumps({"runs": runs, "notes": data.get("notes"), "results": results},
                                          indent=1, default=str))
    if args.plot:
        report.plot(results, args.plot)  # Ember against every peer (speedup vs eager without Ember rows)
    table = report.markdown_table(results)
    if args.md:
        Path(args.md).write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())

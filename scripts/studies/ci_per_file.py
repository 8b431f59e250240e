"""Per-file sums of pytest `--durations=0` reports (setup + call + teardown of every test, both
xdist workers' tests together), one column per report, as a markdown table:

  python -m pytest -q -n 2 --dist loadfile tests --durations=0 > before.txt
  python scripts/studies/ci_per_file.py before.txt [after.txt ...]
"""
import collections
import os
import re
import sys

_ROW = re.compile(r"\s*([0-9.]+)s (call|setup|teardown)\s+(\S+?)::")
_WALL = re.compile(r" in ([0-9.]+)s")


def per_file(report: str) -> tuple[dict[str, float], float | None]:
  """({test file: seconds summed over its tests}, the run's wall seconds if the report has them)."""
  sums, wall = collections.defaultdict(float), None
  with open(report) as fh:
    for line in fh:
      m = _ROW.match(line)
      if m:
        sums[m.group(3)] += float(m.group(1))
      elif ("passed" in line or "failed" in line) and _WALL.search(line):
        wall = float(_WALL.search(line).group(1))
  return dict(sums), wall


def main(reports: list[str]) -> None:
  cols = [per_file(r) for r in reports]
  files = sorted({f for c, _ in cols for f in c}, key=lambda f: -cols[0][0].get(f, 0.0))
  names = [os.path.basename(r) for r in reports]
  print("| test file | " + " | ".join(f"{n} (s)" for n in names) + " |")
  print("|---|" + "---|" * len(names))
  for f in files:
    print(f"| `{f}` | " + " | ".join(f"{c.get(f, 0.0):.0f}" for c, _ in cols) + " |")
  print("| **sum over both workers** | " + " | ".join(f"**{sum(c.values()):.0f}**" for c, _ in cols)
        + " |")
  print("| **pytest wall time** | " + " | ".join(f"**{w:.0f}**" if w else "" for _, w in cols)
        + " |")


if __name__ == "__main__":
  main(sys.argv[1:])

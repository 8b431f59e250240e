"""Per-file sums of a pytest `--durations=0` report (both xdist workers' tests together):

  python scripts/studies/ci_per_file.py REPORT.txt
"""
import collections
import re
import sys

_ROW = re.compile(r"\s*([0-9.]+)s (call|setup|teardown)\s+(\S+?)::")


def main(report: str):
  per_file, per_phase, rows = collections.defaultdict(float), collections.defaultdict(float), 0
  with open(report) as fh:
    for line in fh:
      m = _ROW.match(line)
      if m:
        seconds, phase, path = float(m.group(1)), m.group(2), m.group(3)
        per_file[path] += seconds
        per_phase[phase] += seconds
        rows += 1
  total = sum(per_file.values())
  print(f"{rows} entries, {total:.0f} s summed over both workers; by phase: "
        + ", ".join(f"{k} {v:.0f}" for k, v in per_phase.items()))
  for path, seconds in sorted(per_file.items(), key=lambda x: -x[1]):
    print(f"{seconds:8.1f} s  {100 * seconds / total:5.1f} %  {path}")


if __name__ == "__main__":
  main(sys.argv[1])

"""Per-file sums of a pytest --durations=0 report: python bench_out/ci/per_file.py REPORT.txt"""
import re, sys, collections
per = collections.defaultdict(float); kinds = collections.defaultdict(float); n = 0
for l in open(sys.argv[1]):
  m = re.match(r"\s*([0-9.]+)s (call|setup|teardown)\s+(\S+?)::", l)
  if m:
    s, k, f = float(m.group(1)), m.group(2), m.group(3); per[f] += s; kinds[k] += s; n += 1
tot = sum(per.values())
print(f"{n} entries, {tot:.0f} s summed over both workers; by phase: " + ", ".join(f"{k} {v:.0f}" for k, v in kinds.items()))
for f, s in sorted(per.items(), key=lambda x: -x[1]):
  print(f"{s:8.1f} s  {100*s/tot:5.1f} %  {f}")

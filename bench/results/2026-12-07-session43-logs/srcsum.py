"""Sums an ncu source-page CSV (SASS, one row an instruction) by opcode: for every column whose
name mentions stall sampling, the samples of each opcode (MUFU.EX2 and HGMMA run only in the
consumer warpgroups, F2FP.F16.E4M3 only in the converters). Prints the header's sampling columns,
then a table: opcode, instructions, executed warp-instructions, and each sampling column."""
import collections
import csv
import sys

rows = list(csv.reader(open(sys.argv[1], newline="")))
head = None
for i, r in enumerate(rows):
    if any(c.strip() == "Source" for c in r):
        head, body = r, rows[i + 1:]
        break
if head is None:
    print("no header with a Source column; first rows:", rows[:3])
    sys.exit(0)
src = head.index("Source")
samp = [j for j, c in enumerate(head) if "ampl" in c or "stall" in c.lower()]
execd = [j for j, c in enumerate(head) if c.startswith("Warp Instructions Executed") or c == "Instructions Executed"]
print("columns:", [head[j] for j in samp + execd])


def num(s):
    try:
        return float(s.replace(",", ""))
    except ValueError:
        return 0.0


agg = collections.defaultdict(lambda: [0, 0.0] + [0.0] * len(samp))
for r in body:
    if len(r) <= src:
        continue
    text = r[src].strip()
    if not text:
        continue
    op = text.split()[0]
    if op.startswith("@"):
        op = text.split()[1] if len(text.split()) > 1 else op
    key = op
    a = agg[key]
    a[0] += 1
    a[1] += num(r[execd[0]]) if execd else 0.0
    for n, j in enumerate(samp):
        a[2 + n] += num(r[j]) if j < len(r) else 0.0
tot = [sum(v[2 + n] for v in agg.values()) for n in range(len(samp))]
print("total samples per column:", dict(zip([head[j] for j in samp], tot)))
order = sorted(agg.items(), key=lambda kv: -kv[1][2] if samp else 0)
print("opcode\tinstrs\texecuted\t" + "\t".join(head[j] for j in samp))
for op, v in order[:60]:
    print(op + "\t" + str(v[0]) + "\t" + "%.0f" % v[1] + "\t" + "\t".join("%.0f" % x for x in v[2:]))

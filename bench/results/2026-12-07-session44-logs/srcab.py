"""c1's two srcsum tables (bf16, FP8 E4M3) side by side for the opcodes that run in the consumer
warpgroups only (and the converters' F2FP), each opcode's stall samples times the warps a
scheduler holds (3 on bf16, 4 on FP8: the sampler picks one warp of a scheduler at a time), so
that the columns compare warp time. Usage: srcab.py srcsum_bf16.txt srcsum_fp8_e4m3.txt"""
import sys


def table(path):
    lines = open(path).read().split("\n")
    i = [k for k, l in enumerate(lines) if l.startswith("opcode\t")][0]
    head = lines[i].split("\t")
    rows = {}
    for l in lines[i + 1:]:
        p = l.split("\t")
        if len(p) == len(head):
            rows[p[0]] = dict(zip(head[1:], map(float, p[1:])))
    return rows


b, f = table(sys.argv[1]), table(sys.argv[2])
ops = [("HGMMA.64x128x16.F32.BF16", "HGMMA.64x128x16.F32"), ("MUFU.EX2",) * 2, ("FMNMX",) * 2, ("FADD",) * 2,
       ("FFMA",) * 2, ("WARPGROUP.DEPBAR.LE",) * 2, ("F2FP.BF16.F32.PACK_AB", "F2FP.F16.F32.PACK_AB"),
       ("SHFL.BFLY",) * 2, (None, "F2FP.F16.E4M3.UNPACK_B"), (None, "LDS.128"), (None, "STS.128")]
cols = ["# Samples", "stall_wait", "stall_short_sb", "stall_mio", "stall_barrier", "stall_not_selected",
        "stall_selected", "stall_math", "stall_dispatch"]
print("| opcode (bf16 / FP8) | " + " | ".join(c.replace("stall_", "").replace("# Samples", "all") for c in cols) + " |")
print("|---" * (len(cols) + 1) + "|")
for ob, of in ops:
    rb, rf = b.get(ob, {}) if ob else {}, f.get(of, {})
    cells = ["%.1f / %.1f" % (rb.get(c, 0) * 3e-3, rf.get(c, 0) * 4e-3) for c in cols]
    print("| %s | %s |" % (of, " | ".join(cells)))

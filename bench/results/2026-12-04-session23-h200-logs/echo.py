# Python client round trip against attnecho (no compute): decode 64 rows x 32 heads x 128, bf16,
# one page per sequence (no large page table), CPU or CUDA tensors.
import sys, time, numpy as np, torch, attnserve
target, dev = sys.argv[1], sys.argv[2]
c = attnserve.Client(target, timeout=30)
B = 64
q = torch.randn(B, 32, 128).to(torch.bfloat16).to(dev)
qo = np.arange(B + 1, dtype=np.int32); kvp = np.arange(B + 1, dtype=np.int32)
idx = np.arange(B, dtype=np.int32); last = np.full(B, 16, np.int32)
for label, qq in (("small", q[:1, :1].contiguous()), ("decode64", q)):
    b = qq.shape[0]
    args = (0, qq, qo[:b + 1], kvp[:b + 1], idx[:b], last[:b])
    for _ in range(30): c.prefill(*args)
    ts = []
    for _ in range(300):
        t0 = time.perf_counter(); c.prefill(*args); ts.append(time.perf_counter() - t0)
    ts = np.array(ts) * 1e3
    print(f"echo {label} {dev}: p50 {np.percentile(ts, 50):.3f} mean {ts.mean():.3f} p99 {np.percentile(ts, 99):.3f} ms", flush=True)

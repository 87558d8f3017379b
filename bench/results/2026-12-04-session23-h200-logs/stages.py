# Runs a command between two /metrics scrapes and prints the server's mean stages per request.
import subprocess, sys
sys.path.insert(0, "bench")
from server_handling import KERNELS, SERVER, STAGES, delta, scrape
m = "127.0.0.1:9464"
before = scrape(m)
r = subprocess.run(sys.argv[1:], capture_output=True, text=True)
after = scrape(m)
print(r.stdout[-1500:], r.stderr[-800:])
s = delta(before, after, *SERVER)
n = s["count"] or 1
k = max((delta(before, after, *kk) for kk in KERNELS), key=lambda d: d["count"])
print(f"requests {s['count']:.0f} server mean {s['sum']/n*1e3:.3f} ms kernel {k['sum']/n*1e3:.3f} ms stages " +
      " ".join(f"{st} {delta(before, after, name, label)['sum']/n*1e3:.3f}" for st, name, label in STAGES))

import re,glob,collections,sys
d=collections.defaultdict(dict)
for f in sorted(glob.glob('kb*_*.log')):
    m=re.match(r'(kb8?)_(\w+)_(\w)\.log',f)
    if not m: continue
    pre,v,p=m.groups()
    for line in open(f):
        if line.startswith('RESULT'):
            kv=dict(x.split('=') for x in line.split()[1:])
            key=(kv['workload'],kv['kv_dtype'],kv['page_size'])
            d[key].setdefault(v,[]).append(float(kv['tflops']))
vs=sys.argv[1:]
for k in sorted(d):
    b=d[k].get(vs[0],[])
    out=f"{k[0]:14s} {k[1]:9s} ps{k[2]:3s} {vs[0]} {b}"
    for v in vs[1:]:
        n=d[k].get(v,[])
        r=(sum(n)/len(n))/(sum(b)/len(b)) if b and n else 0
        out+=f" {v} {n} {r:.3f}"
    print(out)

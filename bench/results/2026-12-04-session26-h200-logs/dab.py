import re,sys,glob,collections
d=sys.argv[1]; vs=sys.argv[2].split(',')
res=collections.defaultdict(dict)
order=[]
for v in vs:
  for p in 'abc':
    f=f"{d}/db_{v}_{p}.log"
    try: lines=open(f).read().splitlines()
    except: continue
    for l in lines:
      if not l.startswith('RESULT kernel=decode '): continue
      kv=dict(x.split('=',1) for x in l.split()[1:] if '=' in x)
      key=(kv['workload'],kv['page_size'])
      if key not in order: order.append(key)
      res[key].setdefault(v,[]).append(float(kv['ms_queued']))
      res[key].setdefault('items_'+v,kv['items'])
print("| workload | ps | "+" | ".join(vs)+" | items |")
for k in order:
  r=res[k]; base=sum(r[vs[0]])/len(r[vs[0]])
  cells=[]
  for v in vs:
    if v not in r: cells.append('-'); continue
    m=sum(r[v])/len(r[v])
    cells.append(" / ".join(f"{x:.4f}" for x in r[v])+(f" ({(m/base-1)*100:+.1f}%)" if v!=vs[0] else ""))
  print(f"| {k[0]} | {k[1]} | "+" | ".join(cells)+" | "+" / ".join(r.get('items_'+v,'-') for v in vs)+" |")

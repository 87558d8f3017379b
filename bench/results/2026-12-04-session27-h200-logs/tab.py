import re,glob,collections,sys
rows=collections.defaultdict(dict)
tags=sys.argv[1].split(',')
for t in tags:
    for line in open(t+'.log'):
        if line.startswith('RESULT'):
            d=dict(kv.split('=') for kv in line.split()[1:] if '=' in kv)
            rows[(d['workload'],d['page_size'])][t]=(float(d['tflops']),d['family'])
print('wl ps | '+' | '.join(tags))
for k in sorted(rows):
    print(k[0],k[1],'|',' | '.join(('%.1f'%rows[k][t][0]+(' '+rows[k][t][1] if 'auto' in t else '')) if t in rows[k] else '-' for t in tags))

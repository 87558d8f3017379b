import struct,sys,hashlib
def sections(path):
    b=open(path,'rb').read()
    assert b[:4]==b'\x7fELF' and b[4]==2
    shoff=struct.unpack_from('<Q',b,0x28)[0]; shentsize,shnum,shstrndx=struct.unpack_from('<HHH',b,0x3A)
    hdrs=[struct.unpack_from('<IIQQQQIIQQ',b,shoff+i*shentsize) for i in range(shnum)]
    stro=hdrs[shstrndx][4]
    out={}
    for h in hdrs:
        name=b[stro+h[0]:b.index(b'\0',stro+h[0])].decode()
        if name.startswith('.text.'): out[name]=hashlib.sha1(b[h[4]:h[4]+h[5]]).hexdigest()
    return out
a=sections(sys.argv[1]); c=sections(sys.argv[2])
same=sum(1 for k in a if c.get(k)==a[k]); print(f"{len(a)} / {len(c)} text sections, {same} identical")
for k in a:
    if c.get(k)!=a[k]: print("differs:",k[:150])

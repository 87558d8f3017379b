# s35 c2: is decode's idle DRAM time the pool's layout? A pool row holds every KV head of a slot, so a
# CTA (one KV head) reads 256-byte pieces 1 KB apart at 4 KV heads, but whole 4 KB runs of a 16-row
# page at 1 KV head. Same grid and bytes a CTA: decode_b64 at 4 KV heads against decode_b256 at 1
# (256 items of 4,096 keys each), and 8 x 128k at 4 and 1; three passes alternating; page_size 1 and 16.
source .gpu/common.sh
B=$I/bin
for p in a b c; do
  st d4_$p 60 $B/attnserve_decode_bench --quick --only=decode_b64,decode_b8_128k
  st d1_$p 60 $B/attnserve_decode_bench --quick --kv_heads=1 --only=decode_b256,decode_b8_128k
done
fin

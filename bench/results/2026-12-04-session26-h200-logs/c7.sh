# s26 c7: the committed decode code at 1, 4 and 8 KV heads (--kv_heads; 8 query heads each): does the pool's row width (a CTA reads one head's 256 bytes of every N x 256-byte row) move the bf16 rate? two passes
source .gpu/common.sh
B=$I/bin
W=decode_b64,decode_b256,decode_b8_128k,decode_b64_e4m3,decode_b256_e4m3
for pass in a b; do
  for h in 4 1 8; do st db_kvh${h}_$pass 100 $B/db_k --quick --only=$W --kv_heads=$h; done
done
fin

// The prefill kernel heuristic and the tile table it plans with.
#include "kernels/plan/kernel_select.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/paged_prefill.h"

namespace attnserve {
namespace {

KvGeometry Geo(int32_t h, int32_t kvh, int32_t d) {
  KvGeometry g;
  g.num_layers = 1;
  g.num_pages = 16;
  g.page_size = 1;
  g.num_qo_heads = h;
  g.num_kv_heads = kvh;
  g.head_dim = d;
  return g;
}

TEST(KernelSelect, TileRowsPerHeadDim) {
  EXPECT_EQ(PrefillTileRows(PrefillKernel::kSm80, 64), 128);
  EXPECT_EQ(PrefillTileRows(PrefillKernel::kSm80, 128), 128);
  EXPECT_EQ(PrefillTileRows(PrefillKernel::kSm80, 256), 64);
  EXPECT_EQ(PrefillTileRows(PrefillKernel::kSm80Rows64, 128), 64);
  EXPECT_EQ(PrefillTileRows(PrefillKernel::kSm90, 64), 128);
  EXPECT_EQ(PrefillTileRows(PrefillKernel::kSm90, 128), 128);
  EXPECT_EQ(PrefillTileRows(PrefillKernel::kSm90Fp8Q, 128), 128);
  for (PrefillKernel k : {PrefillKernel::kSm90Overlap, PrefillKernel::kSm90OverlapNoPp}) {
    EXPECT_EQ(PrefillTileRows(k, 64), 128);
    EXPECT_EQ(PrefillTileRows(k, 128), 128);
  }
}

TEST(KernelSelect, Rows64OnlyForShortTilesAtHeadDim128) {
  const PrefillDevice h200{9, 0};
  // decode: 1 token x group 8 = 8 packed rows.
  EXPECT_EQ(ChoosePrefillKernel(Geo(32, 4, 128), h200, 8), PrefillKernel::kSm80Rows64);
  EXPECT_EQ(ChoosePrefillKernel(Geo(32, 4, 128), h200, 64), PrefillKernel::kSm80Rows64);
  EXPECT_EQ(ChoosePrefillKernel(Geo(32, 4, 128), h200, 65), PrefillKernel::kSm80);
  EXPECT_EQ(ChoosePrefillKernel(Geo(32, 4, 64), h200, 8), PrefillKernel::kSm80);
  EXPECT_EQ(ChoosePrefillKernel(Geo(32, 4, 256), h200, 8), PrefillKernel::kSm80);
}

TEST(KernelSelect, NamesAreStableLabels) {
  EXPECT_EQ(std::string(PrefillKernelName(PrefillKernel::kSm80)), "sm80");
  EXPECT_EQ(std::string(PrefillKernelName(PrefillKernel::kSm80Rows64)), "sm80_rows64");
  EXPECT_EQ(std::string(PrefillKernelName(PrefillKernel::kSm90)), "sm90");
  EXPECT_EQ(std::string(PrefillKernelName(PrefillKernel::kSm90Overlap)), "sm90_overlap");
  EXPECT_EQ(std::string(PrefillKernelName(PrefillKernel::kSm90OverlapNoPp)), "sm90_overlap_nopp");
}

TEST(KernelSelect, Sm90KernelsAreTheWgmmaFamily) {
  EXPECT_FALSE(IsSm90Kernel(PrefillKernel::kSm80));
  EXPECT_FALSE(IsSm90Kernel(PrefillKernel::kSm80Rows64));
  EXPECT_TRUE(IsSm90Kernel(PrefillKernel::kSm90));
  EXPECT_TRUE(IsSm90Kernel(PrefillKernel::kSm90Overlap));
  EXPECT_TRUE(IsSm90Kernel(PrefillKernel::kSm90OverlapNoPp));
}

TEST(KernelSelect, ForcedFamilies) {
  const PrefillDevice h200{9, 0};
  // sm90 forced: every batch at head_dim 64 and 128, decode-sized ones too;
  // head_dim 256 stays on sm80.
  for (int64_t rows : {1, 64, 65, 4096}) {
    EXPECT_EQ(ChoosePrefillKernel(Geo(32, 4, 128), h200, rows, PrefillFamily::kSm90), PrefillKernel::kSm90Overlap);
    EXPECT_EQ(ChoosePrefillKernel(Geo(16, 4, 64), h200, rows, PrefillFamily::kSm90), PrefillKernel::kSm90Overlap);
  }
  EXPECT_EQ(ChoosePrefillKernel(Geo(32, 4, 256), h200, 4096, PrefillFamily::kSm90), PrefillKernel::kSm80);
  // sm80 forced: the mma.sync heuristic on Hopper too.
  EXPECT_EQ(ChoosePrefillKernel(Geo(32, 4, 128), h200, 4096, PrefillFamily::kSm80), PrefillKernel::kSm80);
  EXPECT_EQ(ChoosePrefillKernel(Geo(32, 4, 128), h200, 8, PrefillFamily::kSm80), PrefillKernel::kSm80Rows64);
  // auto: the overlapped wgmma kernel on Hopper where rows see long KV
  // ranges on average; sm80 for shorter ones, at head_dim 256, and on every
  // other GPU.
  const PrefillKernel kAuto = PrefillKernel::kSm80;
  EXPECT_EQ(ChoosePrefillKernel(Geo(32, 4, 128), h200, 4096, PrefillFamily::kAuto, kAutoSm90MinMeanKv),
            PrefillKernel::kSm90Overlap);
  EXPECT_EQ(ChoosePrefillKernel(Geo(32, 4, 64), h200, 4096, PrefillFamily::kAuto, 16384), PrefillKernel::kSm90Overlap);
  EXPECT_EQ(ChoosePrefillKernel(Geo(32, 4, 128), h200, 4096, PrefillFamily::kAuto, kAutoSm90MinMeanKv - 1), kAuto);
  EXPECT_EQ(ChoosePrefillKernel(Geo(32, 4, 128), h200, 4096), kAuto);
  EXPECT_EQ(ChoosePrefillKernel(Geo(32, 4, 256), h200, 4096, PrefillFamily::kAuto, 16384), kAuto);
  EXPECT_EQ(ChoosePrefillKernel(Geo(32, 4, 128), h200, 4096, PrefillFamily::kSm80, 16384), kAuto);
  EXPECT_EQ(ChoosePrefillKernel(Geo(32, 4, 128), PrefillDevice{8, 0}, 4096, PrefillFamily::kAuto, 16384), kAuto);
  EXPECT_EQ(ChoosePrefillKernel(Geo(32, 4, 128), PrefillDevice{8, 9}, 4096, PrefillFamily::kAuto, 16384), kAuto);
}

TEST(KernelSelect, FamilyFlagValues) {
  PrefillFamily f = PrefillFamily::kSm80;
  EXPECT_TRUE(ParsePrefillFamily("auto", &f));
  EXPECT_EQ(f, PrefillFamily::kAuto);
  EXPECT_TRUE(ParsePrefillFamily("sm90", &f));
  EXPECT_EQ(f, PrefillFamily::kSm90);
  EXPECT_TRUE(ParsePrefillFamily("sm80", &f));
  EXPECT_EQ(f, PrefillFamily::kSm80);
  EXPECT_TRUE(ParsePrefillFamily("sm90_fp8q", &f));
  EXPECT_EQ(f, PrefillFamily::kSm90Fp8Q);
  for (const char* bad : {"", "SM90", "sm90a", "sm80_rows64", "hopper", "sm90_fp8", "fp8q"}) {
    EXPECT_FALSE(ParsePrefillFamily(bad, &f)) << bad;
  }
  for (PrefillFamily g : {PrefillFamily::kAuto, PrefillFamily::kSm80, PrefillFamily::kSm90, PrefillFamily::kSm90Fp8Q}) {
    PrefillFamily back;
    ASSERT_TRUE(ParsePrefillFamily(PrefillFamilyName(g), &back));
    EXPECT_EQ(back, g);
  }
  EXPECT_TRUE(PrefillFamilyRunsOn(PrefillFamily::kSm90, PrefillDevice{9, 0}));
  EXPECT_FALSE(PrefillFamilyRunsOn(PrefillFamily::kSm90, PrefillDevice{8, 9}));
  EXPECT_FALSE(PrefillFamilyRunsOn(PrefillFamily::kSm90, PrefillDevice{10, 0}));
  EXPECT_TRUE(PrefillFamilyRunsOn(PrefillFamily::kSm80, PrefillDevice{8, 0}));
  EXPECT_TRUE(PrefillFamilyRunsOn(PrefillFamily::kAuto, PrefillDevice{8, 0}));
  EXPECT_TRUE(PrefillFamilyRunsOn(PrefillFamily::kSm90Fp8Q, PrefillDevice{9, 0}));
  EXPECT_FALSE(PrefillFamilyRunsOn(PrefillFamily::kSm90Fp8Q, PrefillDevice{8, 9}));
}

// sm90_fp8q (S = Q K^T in FP8): every prefill batch of an FP8 cache (E4M3
// or E5M2) at head_dim 128 runs kSm90Fp8Q, short and long; no other
// geometry fits the family (the server refuses the flag), and no other
// family picks it.
TEST(KernelSelect, Fp8QueriesFamilyRunsFp8PoolsAtHeadDim128Only) {
  const PrefillDevice h100{9, 0};
  KvGeometry g = Geo(32, 4, 128);
  g.kv_fp8 = Fp8Format::kE4m3;
  KvGeometry e5m2 = g;
  e5m2.kv_fp8 = Fp8Format::kE5m2;
  const char* why = "";
  for (const KvGeometry& f : {g, e5m2}) {
    EXPECT_TRUE(PrefillFamilyFitsGeometry(PrefillFamily::kSm90Fp8Q, f, &why));
    for (int64_t rows : {1, 8, 64, 4096}) {
      for (int64_t mean_kv : {0, 100, 4096}) {
        EXPECT_EQ(ChoosePrefillKernel(f, h100, rows, PrefillFamily::kSm90Fp8Q, mean_kv), PrefillKernel::kSm90Fp8Q);
        for (PrefillFamily other : {PrefillFamily::kAuto, PrefillFamily::kSm80, PrefillFamily::kSm90}) {
          EXPECT_NE(ChoosePrefillKernel(f, h100, rows, other, mean_kv), PrefillKernel::kSm90Fp8Q);
        }
      }
    }
  }
  EXPECT_FALSE(PrefillFamilyFitsGeometry(PrefillFamily::kSm90Fp8Q, Geo(32, 4, 128), &why));
  EXPECT_NE(std::string(why).find("--kv_dtype=fp8_e4m3 or fp8_e5m2"), std::string::npos) << why;
  KvGeometry d64 = g;
  d64.head_dim = 64;
  EXPECT_FALSE(PrefillFamilyFitsGeometry(PrefillFamily::kSm90Fp8Q, d64, &why));
  EXPECT_NE(std::string(why).find("--head_dim=128"), std::string::npos) << why;
  for (PrefillFamily other : {PrefillFamily::kAuto, PrefillFamily::kSm80, PrefillFamily::kSm90}) {
    EXPECT_TRUE(PrefillFamilyFitsGeometry(other, d64, &why));
    EXPECT_TRUE(PrefillFamilyFitsGeometry(other, e5m2, &why));
  }
  EXPECT_TRUE(IsSm90Kernel(PrefillKernel::kSm90Fp8Q));
  EXPECT_EQ(PrefillPersistentCtas(PrefillKernel::kSm90Fp8Q, 132, 1), 132);
  EXPECT_STREQ(PrefillKernelName(PrefillKernel::kSm90Fp8Q), "sm90_fp8q");
}

// FP8 pools choose the kernel a 16-bit pool of the same shape gets, on
// every device and for every family (each kernel the heuristic picks, sm80,
// sm80_rows64, sm90_overlap, reads them), but for auto on Hopper at
// head_dim 64 and 128: sm90_overlap at every length.
TEST(KernelSelect, Fp8PoolsChooseAsSixteenBitPools) {
  int sm90 = 0, sm80 = 0;
  for (const int d : {64, 128, 256}) {
    for (Fp8Format f : {Fp8Format::kE4m3, Fp8Format::kE5m2}) {
      KvGeometry g16 = Geo(32, 4, d);
      KvGeometry g8 = g16;
      g8.kv_fp8 = f;
      for (const PrefillDevice dev : {PrefillDevice{8, 0}, PrefillDevice{8, 9}, PrefillDevice{9, 0}}) {
        for (PrefillFamily fam : {PrefillFamily::kAuto, PrefillFamily::kSm80, PrefillFamily::kSm90}) {
          if (!PrefillFamilyRunsOn(fam, dev)) continue;
          for (int64_t rows : {8, 64, 4096}) {
            for (int64_t mean_kv : {100, 4096}) {
              const PrefillKernel k = ChoosePrefillKernel(g8, dev, rows, fam, mean_kv);
              const bool hopper_auto = fam == PrefillFamily::kAuto && dev.sm_major == 9 && d != 256;
              EXPECT_EQ(k, hopper_auto ? PrefillKernel::kSm90Overlap : ChoosePrefillKernel(g16, dev, rows, fam, mean_kv))
                  << d << " " << PrefillFamilyName(fam) << " " << rows << " " << mean_kv;
              EXPECT_NE(k, PrefillKernel::kSm90);
              EXPECT_NE(k, PrefillKernel::kSm90OverlapNoPp);
              sm90 += k == PrefillKernel::kSm90Overlap;
              sm80 += k == PrefillKernel::kSm80 || k == PrefillKernel::kSm80Rows64;
            }
          }
        }
      }
    }
  }
  EXPECT_GT(sm90, 0);
  EXPECT_GT(sm80, 0);
}

// The sm90 family's loads: tensor copies for 16-bit pools from
// kSm90TensorCopyMinMeanKv keys a row up (or when the mean is not given),
// cp.async below; FP8 pools always tensor copies. The mean is
// MeanKvPerRow's: sum(q_len * kv_len) / sum(q_len).
TEST(KernelSelect, Sm90TensorCopiesFromTheMeanKvPerRow) {
  KvGeometry g16 = Geo(32, 4, 128);
  KvGeometry g8 = g16;
  g8.kv_fp8 = Fp8Format::kE4m3;
  EXPECT_TRUE(Sm90TensorCopies(g16, 0));
  EXPECT_FALSE(Sm90TensorCopies(g16, 1));
  EXPECT_FALSE(Sm90TensorCopies(g16, kSm90TensorCopyMinMeanKv - 1));
  EXPECT_TRUE(Sm90TensorCopies(g16, kSm90TensorCopyMinMeanKv));
  EXPECT_TRUE(Sm90TensorCopies(g16, 16384));
  for (int64_t m : {int64_t{0}, int64_t{1}, int64_t{512}, kSm90TensorCopyMinMeanKv, int64_t{16384}}) {
    EXPECT_TRUE(Sm90TensorCopies(g8, m)) << m;
  }

  std::vector<PrefillSeq> seqs(3);
  seqs[0].q_len = 512;  // 32 x 512 causal's kind: 512 keys a row
  seqs[0].kv_len = 512;
  seqs[1].q_len = 0;  // no rows: not counted
  seqs[1].kv_len = 100000;
  seqs[2].q_len = 1;  // a decode row over 8k keys
  seqs[2].kv_len = 8192;
  EXPECT_EQ(MeanKvPerRow(seqs.data(), 3), (512 * 512 + 8192) / 513);
  EXPECT_EQ(MeanKvPerRow(seqs.data(), 0), 0);
  EXPECT_EQ(MeanKvPerRow(seqs.data() + 1, 1), 0);
  EXPECT_FALSE(Sm90TensorCopies(g16, MeanKvPerRow(seqs.data(), 3)));
}

}  // namespace
}  // namespace attnserve

// The prefill kernel heuristic and the tile table it plans with.
#include "kernels/plan/kernel_select.h"

#include <string>

#include "gtest/gtest.h"

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
}

}  // namespace
}  // namespace attnserve

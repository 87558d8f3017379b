// MessagePool and ResetForReuse: a recycled Prefill pair comes back with
// every field cleared but the response's output buffer still allocated, and
// the pool never keeps more pairs or bytes than its bounds.
#include "server/grpc/message_pool.h"

#include <string>
#include <vector>

#include "attnserve/v1/attention.pb.h"
#include "gtest/gtest.h"
#include "server/grpc/convert.h"

namespace attnserve {
namespace {

using Pool = MessagePool<v1::PrefillRequest, v1::PrefillResponse>;

// Fills a pair as a finished call leaves it.
void FillAsAfterACall(v1::PrefillRequest* req, v1::PrefillResponse* resp, size_t out_bytes) {
  req->set_layer(3);
  req->mutable_q()->mutable_data()->assign(4096, 'q');
  req->add_kv_indices(7);
  req->set_sm_scale(0.5f);
  resp->mutable_output()->mutable_data()->assign(out_bytes, 'o');
  resp->mutable_output()->add_shape(1);
  resp->mutable_output()->set_dtype(v1::DTYPE_BF16);
  resp->mutable_lse()->mutable_data()->assign(64, 'l');
  resp->set_incarnation(42);
}

TEST(MessagePoolTest, RecycledPairIsClearedButKeepsTheOutputBuffer) {
  Pool pool(4, 1 << 20, ResetForReuse);
  auto* h = pool.AllocateMessages();
  FillAsAfterACall(h->request(), h->response(), 100000);
  const char* buffer = h->response()->output().data().data();
  h->Release();
  EXPECT_EQ(pool.pooled(), 1u);
  EXPECT_GE(pool.pooled_bytes(), 100000);

  auto* again = pool.AllocateMessages();
  EXPECT_EQ(again, h) << "the pooled pair was not reused";
  EXPECT_EQ(pool.pooled(), 0u);
  EXPECT_EQ(pool.pooled_bytes(), 0);
  // Every field reads as in a fresh message...
  const v1::PrefillRequest fresh_req;
  const v1::PrefillResponse fresh_resp;
  EXPECT_EQ(again->request()->SerializeAsString(), fresh_req.SerializeAsString());
  EXPECT_FALSE(again->request()->has_sm_scale());
  EXPECT_EQ(again->response()->output().data().size(), 0u);
  EXPECT_EQ(again->response()->output().shape_size(), 0);
  EXPECT_EQ(again->response()->output().dtype(), v1::DTYPE_UNSPECIFIED);
  EXPECT_EQ(again->response()->lse().data().size(), 0u);
  EXPECT_EQ(again->response()->incarnation(), 0u);
  // ...but sizing the output again reuses the same memory.
  EXPECT_GE(again->response()->output().data().capacity(), 100000u);
  again->response()->mutable_output()->mutable_data()->resize(100000);
  EXPECT_EQ(again->response()->output().data().data(), buffer);
  again->Release();
}

TEST(MessagePoolTest, PoolStaysWithinItsPairAndByteBounds) {
  Pool pool(2, 1 << 20, ResetForReuse);
  // A pair holding more than the byte bound is deleted, not kept.
  auto* big = pool.AllocateMessages();
  FillAsAfterACall(big->request(), big->response(), 2 << 20);
  big->Release();
  EXPECT_EQ(pool.pooled(), 0u);
  EXPECT_EQ(pool.pooled_bytes(), 0);
  // At most two pairs are kept.
  std::vector<grpc::MessageHolder<v1::PrefillRequest, v1::PrefillResponse>*> held;
  for (int i = 0; i < 3; ++i) held.push_back(pool.AllocateMessages());
  for (auto* h : held) {
    FillAsAfterACall(h->request(), h->response(), 1000);
    h->Release();
  }
  EXPECT_EQ(pool.pooled(), 2u);
  EXPECT_LE(pool.pooled_bytes(), 1 << 20);
  // A pair whose response was cleared (an error path) is reused too.
  auto* h = pool.AllocateMessages();
  h->response()->Clear();
  h->Release();
  EXPECT_EQ(pool.pooled(), 2u);
}

}  // namespace
}  // namespace attnserve

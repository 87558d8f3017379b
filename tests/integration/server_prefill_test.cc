// Prefill through the real server against the float64 reference: ragged
// batches with every edge case, defaults, shapes, fused appends, the
// incarnation check, and concurrent clients batched together.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include "tests/integration/server_fixture.h"

namespace attnserve {
namespace server_test {
namespace {

// ------------------------------------------------------------ Prefill

TEST_P(ServerTest, RaggedBatchesWithEveryEdgeCaseMatchTheReference) {
  std::mt19937_64 gen(GetParam());
  KvMirror mirror(geo_);
  auto pages = client_->AllocatePages(GetParam() == 1 ? 300 : 24);
  ASSERT_TRUE(pages.ok()) << pages.status();
  for (int32_t layer = 0; layer < 2; ++layer) {
    ASSERT_NO_FATAL_FAILURE(FillPages(*client_, mirror, gen, layer, *pages));
  }
  struct Variant {
    int32_t layer;
    bool causal;
    bool lse_base_e;
    std::optional<float> sm_scale;
  };
  const Variant variants[] = {
      {0, true, false, std::nullopt},
      {1, true, true, std::nullopt},
      {0, false, false, std::nullopt},
      {1, false, true, 0.05f},
      {0, true, false, 0.3f},
  };
  for (const Variant& v : variants) {
    SCOPED_TRACE(absl::StrCat("layer ", v.layer, v.causal ? " causal" : " non-causal",
                              v.lse_base_e ? " base e" : " base 2"));
    PrefillInputs in = EdgeCaseInputs(gen, geo_, *pages, v.layer, v.causal, v.lse_base_e);
    in.sm_scale = v.sm_scale;
    auto out = client_->Prefill(ArgsOf(in));
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_EQ(out->incarnation, client_->info().incarnation());
    const int64_t blind = ExpectMatchesReference(mirror, in, *out);
    EXPECT_GT(blind, 0) << "the batch had no row that sees nothing";
  }
}

TEST_P(ServerTest, CausalDefaultsToTrueAndLseToBaseTwo) {
  std::mt19937_64 gen(7);
  KvMirror mirror(geo_);
  auto pages = client_->AllocatePages(GetParam() == 1 ? 64 : 4);
  ASSERT_TRUE(pages.ok());
  ASSERT_NO_FATAL_FAILURE(FillPages(*client_, mirror, gen, 0, *pages));
  PrefillInputs in = EdgeCaseInputs(gen, geo_, *pages, 0, true, false, 2, 20, 60);
  PrefillArgs args = ArgsOf(in);
  args.causal.reset();  // not sent: the server's default applies
  auto out = client_->Prefill(args);
  ASSERT_TRUE(out.ok()) << out.status();
  ExpectMatchesReference(mirror, in, *out);
}

TEST_P(ServerTest, ResponseTensorsCarryTheirShapes) {
  std::mt19937_64 gen(8);
  auto pages = client_->AllocatePages(2);
  ASSERT_TRUE(pages.ok());
  const std::vector<int64_t> slot = {int64_t{(*pages)[0]} * geo_.page_size};
  const auto row = RandomHalves(gen, geo_.dtype, geo_.RowElems());
  ASSERT_TRUE(client_->WriteKV(0, slot, row, row).ok());  // the one key it reads
  v1::PrefillRequest req;
  req.mutable_q()->set_dtype(v1::DTYPE_BF16);
  req.mutable_q()->add_shape(3);
  req.mutable_q()->add_shape(8);
  req.mutable_q()->add_shape(64);
  const std::vector<uint16_t> q = RandomHalves(gen, geo_.dtype, 3 * 8 * 64);
  req.mutable_q()->set_data(q.data(), q.size() * sizeof(uint16_t));
  for (int32_t x : {0, 3}) req.add_qo_indptr(x);
  for (int32_t x : {0, 1}) req.add_kv_indptr(x);
  req.add_kv_indices((*pages)[0]);
  req.add_kv_last_page_len(1);
  v1::PrefillResponse resp;
  grpc::ClientContext ctx;
  client_->PrepareContext(&ctx);
  grpc::Status s = client_->stub()->Prefill(&ctx, req, &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(resp.output().dtype(), v1::DTYPE_BF16);
  EXPECT_THAT(resp.output().shape(), ::testing::ElementsAre(3, 8, 64));
  EXPECT_EQ(resp.output().data().size(),
            static_cast<size_t>(3 * 8 * 64 * KvDTypeBytes(geo_.dtype)));
  EXPECT_EQ(resp.lse().dtype(), v1::DTYPE_FP32);
  EXPECT_THAT(resp.lse().shape(), ::testing::ElementsAre(3, 8));
  EXPECT_EQ(resp.lse().data().size(), 3u * 8 * 4);
}

TEST_P(ServerTest, FusedAppendIsWrittenBeforeAttention) {
  // Chunked prefill: each sequence has a prefix in the cache and sends its
  // next tokens' K/V with the request; the new rows attend to them.
  std::mt19937_64 gen(GetParam() + 40);
  KvMirror mirror(geo_);
  const int32_t ps = geo_.page_size;
  const int32_t prefix[] = {37, 0, 16, 5};
  const int32_t chunk[] = {9, 12, 1, 30};
  PrefillInputs in;
  in.layer = 1;
  in.qo_indptr = {0};
  in.kv_indptr = {0};
  std::vector<int64_t> append_slots;
  std::vector<int32_t> all_pages;
  for (int b = 0; b < 4; ++b) {
    const int32_t kv_len = prefix[b] + chunk[b];
    const int32_t num_pages = (kv_len + ps - 1) / ps;
    auto pages = client_->AllocatePages(num_pages);
    ASSERT_TRUE(pages.ok()) << pages.status();
    std::reverse(pages->begin(), pages->end());  // out of order in the cache
    all_pages.insert(all_pages.end(), pages->begin(), pages->end());
    std::vector<int64_t> slots;
    for (int32_t j = 0; j < kv_len; ++j) {
      slots.push_back(int64_t{(*pages)[j / ps]} * ps + j % ps);
    }
    // The prefix through WriteKV, the chunk through the Prefill.
    std::vector<int64_t> prefix_slots(slots.begin(), slots.begin() + prefix[b]);
    if (!prefix_slots.empty()) {
      const int64_t n = static_cast<int64_t>(prefix_slots.size()) * geo_.RowElems();
      auto k = RandomHalves(gen, geo_.dtype, n), v = RandomHalves(gen, geo_.dtype, n);
      ASSERT_TRUE(client_->WriteKV(1, prefix_slots, k, v).ok());
      mirror.Write(1, prefix_slots, k, v);
    }
    append_slots.insert(append_slots.end(), slots.begin() + prefix[b], slots.end());
    in.kv_indices.insert(in.kv_indices.end(), pages->begin(), pages->end());
    in.qo_indptr.push_back(in.qo_indptr.back() + chunk[b]);
    in.kv_indptr.push_back(in.kv_indptr.back() + num_pages);
    in.kv_last_page_len.push_back(kv_len - (num_pages - 1) * ps);
  }
  in.q = RandomHalves(gen, geo_.dtype, in.total_q() * geo_.num_qo_heads * geo_.head_dim);
  const int64_t n_append = static_cast<int64_t>(append_slots.size());
  const auto ak = RandomHalves(gen, geo_.dtype, n_append * geo_.RowElems());
  const auto av = RandomHalves(gen, geo_.dtype, n_append * geo_.RowElems());
  PrefillArgs args = ArgsOf(in);
  args.append_slots = append_slots;
  args.append_k = ak;
  args.append_v = av;
  auto out = client_->Prefill(args);
  ASSERT_TRUE(out.ok()) << out.status();
  mirror.Write(1, append_slots, ak, av);
  ExpectMatchesReference(mirror, in, *out);
  // The appended rows stay in the cache, exactly.
  auto back = client_->ReadKV(1, append_slots);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(back->k == ak);
  EXPECT_TRUE(back->v == av);

  // Decode step: one new row per sequence, appended into the next slot.
  PrefillInputs decode = in;
  decode.qo_indptr = {0, 1, 2, 3, 4};
  std::vector<int64_t> next_slots;
  decode.kv_indices.clear();
  decode.kv_indptr = {0};
  decode.kv_last_page_len.clear();
  size_t page_at = 0;
  for (int b = 0; b < 4; ++b) {
    const int32_t kv_len = prefix[b] + chunk[b];
    const int32_t num_pages = (kv_len + ps - 1) / ps;
    std::vector<int32_t> seq_pages(in.kv_indices.begin() + page_at,
                                   in.kv_indices.begin() + page_at + num_pages);
    page_at += num_pages;
    if (kv_len % ps == 0) {  // the last page is full: the new token needs a page
      auto more = client_->AllocatePages(1);
      ASSERT_TRUE(more.ok());
      seq_pages.push_back((*more)[0]);
    }
    next_slots.push_back(int64_t{seq_pages[kv_len / ps]} * ps + kv_len % ps);
    decode.kv_indices.insert(decode.kv_indices.end(), seq_pages.begin(), seq_pages.end());
    decode.kv_indptr.push_back(decode.kv_indptr.back() + static_cast<int32_t>(seq_pages.size()));
    decode.kv_last_page_len.push_back(kv_len + 1 - (static_cast<int32_t>(seq_pages.size()) - 1) * ps);
  }
  decode.q = RandomHalves(gen, geo_.dtype, 4 * geo_.num_qo_heads * geo_.head_dim);
  const auto dk = RandomHalves(gen, geo_.dtype, 4 * geo_.RowElems());
  const auto dv = RandomHalves(gen, geo_.dtype, 4 * geo_.RowElems());
  PrefillArgs dargs = ArgsOf(decode);
  dargs.append_slots = next_slots;
  dargs.append_k = dk;
  dargs.append_v = dv;
  auto dout = client_->Prefill(dargs);
  ASSERT_TRUE(dout.ok()) << dout.status();
  mirror.Write(1, next_slots, dk, dv);
  EXPECT_EQ(ExpectMatchesReference(mirror, decode, *dout), 0);
}

TEST_P(ServerTest, ExpectedIncarnationIsChecked) {
  std::mt19937_64 gen(9);
  KvMirror mirror(geo_);
  auto pages = client_->AllocatePages(GetParam() == 1 ? 32 : 2);
  ASSERT_TRUE(pages.ok());
  ASSERT_NO_FATAL_FAILURE(FillPages(*client_, mirror, gen, 0, *pages));
  PrefillInputs in = EdgeCaseInputs(gen, geo_, *pages, 0, true, false, 1, 8, 30);
  PrefillArgs args = ArgsOf(in);
  args.expected_incarnation = client_->info().incarnation();
  auto out = client_->Prefill(args);
  ASSERT_TRUE(out.ok()) << out.status();
  ExpectMatchesReference(mirror, in, *out);
  args.expected_incarnation = client_->info().incarnation() ^ 1;
  auto stale = client_->Prefill(args);
  EXPECT_EQ(stale.status().code(), absl::StatusCode::kFailedPrecondition) << stale.status();
  EXPECT_THAT(std::string(stale.status().message()), HasSubstr("expected_incarnation"));
}


// ------------------------------------------------------------ concurrency

TEST_P(ServerTest, ConcurrentClientsGetCorrectResultsInFewerBatchesThanRequests) {
  constexpr int kClients = 16, kRequestsEach = 4;
  auto metrics_before = HttpGet(server_->metrics_address(), "/metrics");
  ASSERT_TRUE(metrics_before.ok()) << metrics_before.status();
  const double batches_before =
      MetricValue(*metrics_before, "attnserve_batch_requests_count").value_or(0);
  const double requests_before =
      MetricValue(*metrics_before, "attnserve_batch_requests_sum").value_or(0);
  const double ok_before = OkPrefills(*metrics_before);

  // Every client first fills its own pages, then all send their requests at
  // once, so that requests arrive while earlier batches run.
  absl::Mutex mu;
  int ready = 0;
  std::vector<std::string> errors(kClients);
  std::vector<std::thread> threads;
  for (int t = 0; t < kClients; ++t) {
    threads.emplace_back([&, t] {
      auto client = Connect(*server_);
      std::mt19937_64 gen(1000 + t);
      KvMirror mirror(geo_);
      WorkloadSpec spec;
      spec.batch = 3;
      spec.max_q_len = 48;
      spec.max_kv_len = 160;
      spec.layer = t % 2;
      spec.causal = t % 3 != 0;
      spec.lse_base_e = t % 4 == 0;
      absl::StatusOr<std::vector<int32_t>> pages =
          client ? client->AllocatePages(static_cast<int32_t>(PagesNeeded(geo_, spec)))
                 : absl::UnavailableError("no client");
      if (pages.ok()) {
        const std::vector<int64_t> slots = SlotsOfPages(geo_, *pages);
        const int64_t n = static_cast<int64_t>(slots.size()) * geo_.RowElems();
        auto k = RandomHalves(gen, geo_.dtype, n), v = RandomHalves(gen, geo_.dtype, n);
        absl::Status s = client->WriteKV(spec.layer, slots, k, v);
        if (!s.ok()) errors[t] = s.ToString();
        mirror.Write(spec.layer, slots, k, v);
      } else {
        errors[t] = pages.status().ToString();
      }
      {
        absl::MutexLock lock(&mu);
        ++ready;
        auto all_ready = [&] { return ready == kClients; };
        mu.Await(absl::Condition(&all_ready));
      }
      if (!errors[t].empty()) return;
      for (int i = 0; i < kRequestsEach; ++i) {
        PrefillInputs in = RandomPrefill(gen, geo_, spec, *pages);
        auto out = client->Prefill(ArgsOf(in));
        if (!out.ok()) {
          errors[t] = out.status().ToString();
          return;
        }
        std::vector<double> o_ref, lse_ref;
        ReferencePrefill(mirror, in, &o_ref, &lse_ref);
        const Comparison c = Compare(geo_.dtype, o_ref, lse_ref, out->o, out->lse);
        if (!c.Ok(geo_.dtype)) {
          errors[t] = absl::StrCat("request ", i, ": ", c.ToString());
          return;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < kClients; ++t) EXPECT_EQ(errors[t], "") << "client " << t;

  auto metrics_after = HttpGet(server_->metrics_address(), "/metrics");
  ASSERT_TRUE(metrics_after.ok()) << metrics_after.status();
  auto batches_after = MetricValue(*metrics_after, "attnserve_batch_requests_count");
  auto requests_after = MetricValue(*metrics_after, "attnserve_batch_requests_sum");
  const double ok_after = OkPrefills(*metrics_after);
  ASSERT_TRUE(batches_after.ok() && requests_after.ok()) << *metrics_after;
  const double batches = *batches_after - batches_before;
  const double requests = *requests_after - requests_before;
  EXPECT_EQ(requests, kClients * kRequestsEach);
  EXPECT_EQ(ok_after - ok_before, kClients * kRequestsEach);
  EXPECT_GE(batches, 1);
  EXPECT_LT(batches, requests) << "every request ran in a batch of its own";
  std::printf("%d concurrent Prefill requests served in %.0f backend batches\n",
              kClients * kRequestsEach, batches);
}

// A client that polls for its responses (ClientOptions::busy_poll) gets the
// same answers and the same errors; each Prefill is counted once in every
// request stage of /metrics.
TEST_P(ServerTest, BusyPollClientGetsTheSameResultsAndErrors) {
  ClientOptions options;
  options.target = server_->grpc_address();
  options.timeout_s = 120;
  options.busy_poll = true;
  auto polling = Client::Connect(options);
  ASSERT_TRUE(polling.ok()) << polling.status();
  std::mt19937_64 gen(GetParam() + 40);
  KvMirror mirror(geo_);
  auto pages = (*polling)->AllocatePages(GetParam() == 1 ? 64 : 6);
  ASSERT_TRUE(pages.ok()) << pages.status();
  ASSERT_NO_FATAL_FAILURE(FillPages(**polling, mirror, gen, 1, *pages));
  const std::string before = *HttpGet(server_->metrics_address(), "/metrics");
  PrefillInputs in = EdgeCaseInputs(gen, geo_, *pages, 1, true, false);
  auto out = (*polling)->Prefill(ArgsOf(in));
  ASSERT_TRUE(out.ok()) << out.status();
  ExpectMatchesReference(mirror, in, *out);
  auto same = client_->Prefill(ArgsOf(in));
  ASSERT_TRUE(same.ok()) << same.status();
  EXPECT_EQ(out->o, same->o);
  const std::string after = *HttpGet(server_->metrics_address(), "/metrics");
  for (const char* stage : {"parse", "admit", "respond", "send"}) {
    const std::string label = absl::StrCat("stage=\"", stage, "\"");
    // The send stage of the last call may be observed just after its client returned.
    const double n = *MetricValue(after, "attnserve_request_stage_seconds_count", label) -
                     *MetricValue(before, "attnserve_request_stage_seconds_count", label);
    EXPECT_GE(n, std::string(stage) == "send" ? 0 : 1) << stage;
    EXPECT_LE(n, 2) << stage;
  }
  // Errors come back as from the blocking path: the field and the bound.
  PrefillArgs bad = ArgsOf(in);
  bad.layer = geo_.num_layers;
  auto refused = (*polling)->Prefill(bad);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("layer"), std::string::npos) << refused.status();
  // A deadline still ends a polled call: against a listener that accepts
  // the connection and never speaks, only the deadline can end it. (A tiny
  // deadline against the real server raced its answer.)
  const int silent = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(silent, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(silent, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(listen(silent, 4), 0);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(getsockname(silent, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  ClientOptions hurried = options;
  hurried.target = absl::StrCat("127.0.0.1:", ntohs(addr.sin_port));
  hurried.timeout_s = 0.3;
  hurried.fetch_info = false;
  auto late = Client::Connect(hurried);
  ASSERT_TRUE(late.ok()) << late.status();
  auto expired = (*late)->Prefill(ArgsOf(in));  // a hang here is ctest's timeout
  close(silent);
  ASSERT_FALSE(expired.ok());
  EXPECT_EQ(expired.status().code(), absl::StatusCode::kDeadlineExceeded) << expired.status();
}

}  // namespace
}  // namespace server_test
}  // namespace attnserve

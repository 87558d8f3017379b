#include "server/core/written_rows.h"

#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace attnserve {
namespace {

using ::testing::HasSubstr;

KvGeometry Geometry() {
  KvGeometry g;
  g.num_layers = 2;
  g.num_pages = 8;
  g.page_size = 4;
  g.num_qo_heads = 2;
  g.num_kv_heads = 1;
  g.head_dim = 64;
  return g;
}

// One sequence over `pages` with kv_len keys, optionally appending `slots`.
PrefillTask Task(int32_t layer, const std::vector<int32_t>& pages, int32_t kv_len,
                 const std::vector<int64_t>& slots = {}) {
  PrefillTask t;
  t.layer = layer;
  PrefillSeq seq;
  seq.q_len = 1;
  seq.kv_len = kv_len;
  seq.layer = layer;
  t.seqs.push_back(seq);
  t.kv_indices = pages.data();
  t.num_kv_indices = static_cast<int32_t>(pages.size());
  t.append_slots = slots.data();
  t.num_append = static_cast<int64_t>(slots.size());
  return t;
}

TEST(WrittenRowsTest, APrefillMayReadOnlyRowsWrittenInItsLayer) {
  WrittenRows written(Geometry());
  const std::vector<int32_t> pages = {3, 5};
  // Nothing written: reading one key is refused, naming what is missing.
  absl::Status s = written.CheckPrefill(Task(0, pages, 1));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("sequence 0 reads rows [0, 1) of page 3 (kv_indices[0]) in "
                                     "layer 0, but row 0 was never written there"));
  EXPECT_THAT(s.message(), HasSubstr("--check_kv_written=false"));
  EXPECT_THAT(s.message(), ::testing::Not(HasSubstr("incarnation")));  // not a restart
  // Page 3 whole and two rows of page 5, in layer 0.
  const std::vector<int64_t> slots = {12, 13, 14, 15, 20, 21};
  written.Mark(0, slots.data(), static_cast<int64_t>(slots.size()));
  EXPECT_TRUE(written.CheckPrefill(Task(0, pages, 6)).ok());
  EXPECT_TRUE(written.CheckPrefill(Task(0, pages, 5)).ok());
  s = written.CheckPrefill(Task(0, pages, 7));  // one row past what was written
  EXPECT_THAT(s.message(), HasSubstr("reads rows [0, 3) of page 5 (kv_indices[1])"));
  EXPECT_THAT(s.message(), HasSubstr("row 2 was never written"));
  // Layer 1 has none of it.
  EXPECT_FALSE(written.CheckPrefill(Task(1, pages, 1)).ok());
  // A task that left out sequences without query rows names the sequence by
  // its number in the request (PrefillTask::seq_numbers).
  PrefillTask numbered = Task(1, pages, 1);
  numbered.seq_numbers = {4};
  EXPECT_THAT(written.CheckPrefill(numbered).message(), HasSubstr("sequence 4 reads rows [0, 1) of page 3"));
}

TEST(WrittenRowsTest, ARequestsOwnAppendsCount) {
  WrittenRows written(Geometry());
  const std::vector<int32_t> pages = {2};
  const std::vector<int64_t> first = {8, 9};
  written.Mark(0, first.data(), 2);
  // A decode step: two keys there, the third appended by the request itself.
  EXPECT_TRUE(written.CheckPrefill(Task(0, pages, 3, {10})).ok());
  // An append elsewhere does not fill this page's hole.
  EXPECT_FALSE(written.CheckPrefill(Task(0, pages, 4, {10, 28})).ok());
  // A row above a hole does not fill it: rows count one by one.
  const std::vector<int64_t> top = {11};
  written.Mark(0, top.data(), 1);
  absl::Status s = written.CheckPrefill(Task(0, pages, 4));
  EXPECT_THAT(s.message(), HasSubstr("row 2 was never written"));
  EXPECT_TRUE(written.CheckPrefill(Task(0, pages, 4, {10})).ok());
  // Writing a row again keeps it written.
  written.Mark(0, first.data(), 1);
  EXPECT_FALSE(written.CheckPrefill(Task(0, pages, 3)).ok());
}

TEST(WrittenRowsTest, APlansCheckLooksOnlyAtPagesNotYetWholeInEveryLayer) {
  WrittenRows written(Geometry());  // 2 layers, pages of 4 rows
  const std::vector<int32_t> pages = {3, 5, 6};
  const PrefillTask task = Task(0, pages, 10);  // pages 3 and 5 whole, 2 rows of page 6
  using Positions = std::vector<std::pair<int32_t, int32_t>>;
  auto unsettled = [&] {
    Positions out;
    for (const auto& p : written.Unsettled(task.seqs, task.kv_indices)) {
      out.emplace_back(p.seq, p.index);
    }
    return out;
  };
  EXPECT_EQ(unsettled(), (Positions{{0, 0}, {0, 1}, {0, 2}}));
  // Page 3 whole in layer 0 only, then in both; page 5 whole in layer 1 by
  // two writes; the partial last page is always looked at.
  const std::vector<int64_t> p3 = {12, 13, 14, 15};
  written.Mark(0, p3.data(), 4);
  EXPECT_EQ(unsettled(), (Positions{{0, 0}, {0, 1}, {0, 2}}));
  written.Mark(1, p3.data(), 4);
  EXPECT_EQ(unsettled(), (Positions{{0, 1}, {0, 2}}));
  const std::vector<int64_t> p5a = {20, 21}, p5b = {23, 22}, p6 = {24, 25, 26, 27};
  written.Mark(1, p5a.data(), 2);
  written.Mark(1, p5b.data(), 2);
  written.Mark(0, p6.data(), 4);
  written.Mark(1, p6.data(), 4);
  EXPECT_EQ(unsettled(), (Positions{{0, 1}, {0, 2}}));  // page 5 not whole in layer 0
  // With the positions, pages outside them are not looked at: page 5's
  // missing rows in layer 0 are found only while it is among them.
  const std::vector<WrittenRows::Position> still = written.Unsettled(task.seqs, task.kv_indices);
  absl::Status s = written.CheckPrefill(task, &still);
  EXPECT_THAT(s.message(), HasSubstr("page 5 (kv_indices[1]) in layer 0"));
  EXPECT_TRUE(written.CheckPrefill(Task(1, pages, 10), &still).ok());
  written.Mark(0, p5a.data(), 2);
  written.Mark(0, p5b.data(), 2);
  EXPECT_EQ(unsettled(), (Positions{{0, 2}}));
  const std::vector<WrittenRows::Position> settled = written.Unsettled(task.seqs, task.kv_indices);
  EXPECT_TRUE(written.CheckPrefill(task, &settled).ok());
  // A new owner's pages start unwritten again, in the count too.
  const std::vector<int32_t> again = {3};
  written.Reset(again);
  EXPECT_EQ(unsettled(), (Positions{{0, 0}, {0, 2}}));
  EXPECT_FALSE(written.CheckPrefill(task).ok());
}

// A plan's sequence without query rows reads nothing, so its pages are not
// looked at: its partial last page, never written, refused every Prefill of
// the plan, where the same layout without a plan was accepted.
TEST(WrittenRowsTest, APlansSequenceWithoutQueryRowsIsNotLookedAt) {
  WrittenRows written(Geometry());
  const std::vector<int32_t> pages = {3, 5, 6};
  PrefillTask task = Task(0, pages, 10);
  PrefillSeq empty = task.seqs[0];
  empty.q_len = 0;
  empty.kv_start = 2;  // page 6, 2 of its rows: unwritten
  empty.kv_len = 2;
  task.seqs.push_back(empty);
  const std::vector<int64_t> whole = {12, 13, 14, 15, 20, 21, 22, 23, 24, 25};
  written.Mark(0, whole.data(), 10);
  written.Mark(1, whole.data(), 10);
  const std::vector<WrittenRows::Position> at = written.Unsettled(task.seqs, task.kv_indices);
  for (const auto& p : at) EXPECT_EQ(p.seq, 0) << "looked at the sequence without query rows";
  EXPECT_TRUE(written.CheckPrefill(task, &at).ok());
}

TEST(WrittenRowsTest, EveryPageSizeAndRow) {
  for (int32_t page_size : {1, 7, 8, 9, 16, 128}) {
    KvGeometry g = Geometry();
    g.page_size = page_size;
    WrittenRows written(g);
    const std::vector<int32_t> pages = {6};
    for (int32_t row = 0; row < page_size; ++row) {
      // Rows [0, row) written: reading row + 1 rows misses exactly `row`.
      absl::Status s = written.CheckPrefill(Task(1, pages, row + 1));
      EXPECT_THAT(s.message(), HasSubstr(absl::StrCat("row ", row, " was never written")))
          << page_size;
      const int64_t slot = int64_t{6} * page_size + row;
      written.Mark(1, &slot, 1);
      EXPECT_TRUE(written.CheckPrefill(Task(1, pages, row + 1)).ok()) << page_size << " " << row;
    }
    EXPECT_FALSE(written.CheckPrefill(Task(0, pages, 1)).ok());  // another layer
  }
}

TEST(WrittenRowsTest, AllocationForgetsWhatAPageHeld) {
  WrittenRows written(Geometry());
  const std::vector<int64_t> slots = {4, 5, 6, 7};
  written.Mark(0, slots.data(), 4);
  written.Mark(1, slots.data(), 4);
  const std::vector<int32_t> pages = {1};
  EXPECT_TRUE(written.CheckPrefill(Task(1, pages, 4)).ok());
  written.Reset(pages);  // freed and allocated again
  EXPECT_FALSE(written.CheckPrefill(Task(0, pages, 1)).ok());
  EXPECT_FALSE(written.CheckPrefill(Task(1, pages, 1)).ok());
}

TEST(WrittenRowsTest, TheMarkerMarksItsSlotsWhenRun) {
  // The scheduler runs it only for a job that succeeded (Job::on_success;
  // tests/core/scheduler_pipeline_test.cc).
  WrittenRows written(Geometry());
  const std::vector<int64_t> slots = {0, 1};
  const std::vector<int32_t> pages = {0};
  std::function<void()> mark = written.Marker(0, slots.data(), 2, nullptr);
  ASSERT_TRUE(mark);
  EXPECT_FALSE(written.CheckPrefill(Task(0, pages, 2)).ok());
  mark();
  EXPECT_TRUE(written.CheckPrefill(Task(0, pages, 2)).ok());
  EXPECT_FALSE(written.Marker(0, slots.data(), 0, nullptr));  // nothing to mark
}

TEST(WrittenRowsTest, TheMarkerHoldsWhatTheSlotsLiveInAsLongAsItLives) {
  // A plan's slots: the marker keeps the plan alive, and the job that holds
  // the marker is destroyed before the client hears back, so that its
  // ReleasePlan and FreePages right after find the plan's pins gone.
  WrittenRows written(Geometry());
  const std::vector<int64_t> slots = {0};
  auto plan = std::make_shared<std::vector<int64_t>>(slots);
  std::weak_ptr<std::vector<int64_t>> seen = plan;
  std::function<void()> mark = written.Marker(0, plan->data(), 1, plan);
  plan.reset();
  EXPECT_FALSE(seen.expired());
  mark();
  mark = nullptr;
  EXPECT_TRUE(seen.expired());
}

}  // namespace
}  // namespace attnserve

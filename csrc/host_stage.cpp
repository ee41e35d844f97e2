#include "host_stage.h"

#include <algorithm>

#include "executor.h"

namespace coalesced_bcast {
namespace {

// Below this a run is not cut, and a bucket's runs below it in all are copied
// on the calling thread: waking threads costs more than the copy.
constexpr int64_t kMinShare = 1 << 20;

}  // namespace

HostStager::HostStager(int64_t threads) {
  for (int64_t i = 1; i < threads; ++i) workers_.emplace_back([this] { work(); });
}

HostStager::~HostStager() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  for (auto& t : workers_) t.join();
}

void HostStager::work() {
  uint64_t seen = 0;
  for (;;) {
    std::unique_lock<std::mutex> lock(mu_);
    wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
    if (stop_) return;
    seen = generation_;
    while (next_ < tasks_) {
      const int64_t task = next_++;
      lock.unlock();
      (*fn_)(task);
      lock.lock();
      if (--pending_ == 0) done_.notify_all();
    }
  }
}

void HostStager::run(int64_t tasks, const std::function<void(int64_t)>& fn) {
  if (workers_.empty() || tasks <= 1) {
    for (int64_t t = 0; t < tasks; ++t) fn(t);
    return;
  }
  std::unique_lock<std::mutex> lock(mu_);
  fn_ = &fn;
  tasks_ = tasks;
  next_ = 0;
  pending_ = tasks;
  ++generation_;
  wake_.notify_all();
  while (next_ < tasks_) {  // the calling thread works too
    const int64_t task = next_++;
    lock.unlock();
    fn(task);
    lock.lock();
    --pending_;
  }
  done_.wait(lock, [&] { return pending_ == 0; });
  fn_ = nullptr;
}

void HostStager::stage(const CopyOp* ops, int64_t count, const std::vector<Layout>& layouts, uint8_t* bucket) {
  int64_t total = 0;
  for (int64_t i = 0; i < count; ++i) total += ops[i].nbytes;
  const auto shares = static_cast<int64_t>(workers_.size()) + 1;
  if (shares == 1 || total < kMinShare) {
    copy_runs_cpu(ops, count, layouts, bucket, /*pack=*/true);
    return;
  }
  // Cut contiguous runs so that each share has about total / shares bytes;
  // strided runs stay whole (their element walk does not split cheaply).
  const int64_t per = std::max(kMinShare, (total + shares - 1) / shares);
  parts_.clear();
  std::vector<int64_t> starts{0};
  int64_t filled = 0;
  for (int64_t i = 0; i < count; ++i) {
    CopyOp op = ops[i];
    while (op.layout < 0 && filled + op.nbytes > per) {
      CopyOp head = op;
      head.nbytes = per - filled;
      parts_.push_back(head);
      op.tensor_offset += head.nbytes;
      op.bucket_offset += head.nbytes;
      op.nbytes -= head.nbytes;
      starts.push_back(static_cast<int64_t>(parts_.size()));
      filled = 0;
    }
    parts_.push_back(op);
    filled += op.nbytes;
    if (filled >= per) {
      starts.push_back(static_cast<int64_t>(parts_.size()));
      filled = 0;
    }
  }
  if (starts.back() != static_cast<int64_t>(parts_.size())) starts.push_back(static_cast<int64_t>(parts_.size()));
  run(static_cast<int64_t>(starts.size()) - 1, [&](int64_t s) {
    copy_runs_cpu(parts_.data() + starts[s], starts[s + 1] - starts[s], layouts, bucket, /*pack=*/true);
  });
}

}  // namespace coalesced_bcast

#include "host_stage.h"

#include <algorithm>
#include <exception>
#include <utility>

#include "executor.h"

namespace coalesced_bcast {
namespace {

// Below this a run is not cut, and a bucket's runs below it in all are copied
// on the calling thread: waking threads costs more than the copy.
constexpr int64_t kMinShare = 1 << 20;

}  // namespace

HostStager::HostStager(int64_t threads) : threads_(threads) {}

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
      attempt(task);
      lock.lock();
      if (--pending_ == 0) done_.notify_all();
    }
  }
}

void HostStager::run(int64_t tasks, const std::function<void(int64_t)>& fn) {
  last_shares_ = tasks;
  if (threads_ <= 1 || tasks <= 1) {
    for (int64_t t = 0; t < tasks; ++t) fn(t);
    return;
  }
  // Started at the first work that is shared out: most executors never stage.
  while (static_cast<int64_t>(workers_.size()) + 1 < threads_) workers_.emplace_back([this] { work(); });
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
    attempt(task);
    lock.lock();
    --pending_;
  }
  done_.wait(lock, [&] { return pending_ == 0; });
  fn_ = nullptr;
  if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
}

// A task that throws (a cast's allocation) must neither end a worker thread (std::terminate) nor leave the
// others running on `fn_` after run() unwinds: the first error is kept and rethrown by run() once all are done.
void HostStager::attempt(int64_t task) {
  try {
    (*fn_)(task);
  } catch (...) {
    std::lock_guard<std::mutex> lock(error_mu_);
    if (!error_) error_ = std::current_exception();
  }
}

namespace {

// Cuts ops[0, count) into shares of about `per` bytes each (bytes(op)): `parts` gets the runs, cut where
// cut(op, bytes) splits off a head of at most that many bytes (false: the run stays whole); returns
// where each share starts in `parts`, and its end.
template <typename Op, typename Bytes, typename Cut>
std::vector<int64_t> cut_into_shares(const Op* ops, int64_t count, int64_t per, std::vector<Op>& parts,
                                     const Bytes& bytes, const Cut& cut) {
  parts.clear();
  std::vector<int64_t> starts{0};
  int64_t filled = 0;
  for (int64_t i = 0; i < count; ++i) {
    Op op = ops[i];
    Op head;
    while (filled + bytes(op) > per && cut(op, per - filled, head)) {
      parts.push_back(head);
      starts.push_back(static_cast<int64_t>(parts.size()));
      filled = 0;
    }
    parts.push_back(op);
    filled += bytes(op);
    if (filled >= per) {
      starts.push_back(static_cast<int64_t>(parts.size()));
      filled = 0;
    }
  }
  if (starts.back() != static_cast<int64_t>(parts.size())) starts.push_back(static_cast<int64_t>(parts.size()));
  return starts;
}

}  // namespace

void HostStager::stage(const CopyOp* ops, int64_t count, const std::vector<Layout>& layouts, uint8_t* bucket) {
  const auto bytes = [](const CopyOp& op) { return op.nbytes; };
  int64_t total = 0;
  for (int64_t i = 0; i < count; ++i) total += bytes(ops[i]);
  const auto shares = std::max<int64_t>(threads_, 1);  // the workers start in run(): not workers_.size()
  if (shares == 1 || total < kMinShare) {
    last_shares_ = 1;
    copy_runs_cpu(ops, count, layouts, bucket, /*pack=*/true);
    return;
  }
  // Contiguous runs are cut; strided runs stay whole (their element walk does not split cheaply).
  const auto cut = [](CopyOp& op, int64_t room, CopyOp& head) {
    if (op.layout >= 0) return false;
    head = op;
    head.nbytes = room;
    op.tensor_offset += room;
    op.bucket_offset += room;
    op.nbytes -= room;
    return true;
  };
  const auto starts = cut_into_shares(ops, count, std::max(kMinShare, (total + shares - 1) / shares), parts_, bytes, cut);
  run(static_cast<int64_t>(starts.size()) - 1, [&](int64_t s) {
    copy_runs_cpu(parts_.data() + starts[s], starts[s + 1] - starts[s], layouts, bucket, /*pack=*/true);
  });
}

void HostStager::scatter(const ScatterOp* ops, int64_t count, const std::vector<Box>& boxes, const uint8_t* bucket) {
  const auto src_base = reinterpret_cast<uintptr_t>(bucket);
  const auto bytes = [](const ScatterOp& op) { return op.count * op.dst_size; };
  int64_t total = 0;
  for (int64_t i = 0; i < count; ++i) total += bytes(ops[i]);
  const auto shares = std::max<int64_t>(threads_, 1);
  if (shares == 1 || total < kMinShare) {
    last_shares_ = 1;
    copy_cast_runs_cpu(ops, count, boxes, src_base, 0);
    return;
  }
  // Runs are cut by elements (a boxed run's elements are those of its span, written where they fall in
  // the box). A cast run stays whole: torch's CPU cast rounds NaN payloads one way in its vectorized
  // body and another in its scalar tail, and cut pieces would move the tails.
  const auto cut = [](ScatterOp& op, int64_t room, ScatterOp& head) {
    const int64_t n = std::max<int64_t>(1, room / op.dst_size);
    if (op.src_type != op.dst_type || n >= op.count) return false;
    head = op;
    head.count = n;
    op.first += n;
    op.bucket_offset += n * op.src_size;
    op.count -= n;
    return true;
  };
  const auto starts =
      cut_into_shares(ops, count, std::max(kMinShare, (total + shares - 1) / shares), scatter_parts_, bytes, cut);
  run(static_cast<int64_t>(starts.size()) - 1, [&](int64_t s) {
    copy_cast_runs_cpu(scatter_parts_.data() + starts[s], starts[s + 1] - starts[s], boxes, src_base, 0);
  });
}

}  // namespace coalesced_bcast

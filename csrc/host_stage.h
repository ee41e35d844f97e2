// host stage: a load's source copies its host-memory runs (pageable or
// memory-mapped checkpoint tensors) into a pinned bucket with a few threads,
// so that the host-to-device copy of one bucket overlaps the staging of the next;
// a rank whose shards lie in pageable host memory (FSDP2's CPU offload without
// pinning) writes them out of a pinned copy of the bucket the same way.
#pragma once

#include <condition_variable>
#include <exception>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "copy_table.h"

namespace coalesced_bcast {

// Its threads (threads - 1 beside the caller's) start at the first stage() or
// scatter() that shares work out, so an executor that never stages pays nothing.
class HostStager {
 public:
  explicit HostStager(int64_t threads);
  ~HostStager();
  HostStager(const HostStager&) = delete;
  HostStager& operator=(const HostStager&) = delete;

  // Packs `ops[0, count)` into `bucket` (host memory) at their bucket offsets,
  // spread over the threads by bytes; returns when every byte is there.
  void stage(const CopyOp* ops, int64_t count, const std::vector<Layout>& layouts, uint8_t* bucket);
  // Writes the cast-copy runs `ops[0, count)` out of `bucket` (host memory, read at src_base +
  // bucket_offset) into the tensors, spread over the threads by bytes; returns when all are written.
  void scatter(const ScatterOp* ops, int64_t count, const std::vector<Box>& boxes, const uint8_t* bucket);
  // The shares the last stage() or scatter() was cut into (1: all on the calling thread).
  int64_t last_shares() const { return last_shares_; }

 private:
  void work();
  void run(int64_t tasks, const std::function<void(int64_t)>& fn);
  void attempt(int64_t task);

  int64_t threads_;
  int64_t last_shares_ = 0;
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable wake_, done_;
  const std::function<void(int64_t)>* fn_ = nullptr;
  int64_t tasks_ = 0, next_ = 0, pending_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
  std::mutex error_mu_;  // apart from mu_: a task's error is kept while mu_ is released
  std::exception_ptr error_;
  std::vector<CopyOp> parts_;  // the runs of one stage() cut into about equal shares
  std::vector<ScatterOp> scatter_parts_;  // and of one scatter()
};

}  // namespace coalesced_bcast

// host_memory: whether a host tensor is page-locked, without asking CUDA for
// torch's own allocations. is_pinned() asks CUDA (cudaPointerGetAttributes), a
// few microseconds a tensor, which over an offloaded FSDP2 model's many
// parameters dominates its load's planning. The storage's deleter says which of
// torch's allocators made it.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/UniqueVoidPtr.h>

namespace coalesced_bcast {

// The deleters of torch's CPU and pinned host allocators, found once per
// process on a block of each; both null where they cannot be told apart (a
// build or machine without a pinned allocator).
struct HostDeleters {
  c10::DeleterFnPtr cpu = nullptr;
  c10::DeleterFnPtr pinned = nullptr;
};
const HostDeleters& host_deleters();

// t.is_pinned() for a host tensor: yes for torch's pinned allocator, no for its
// CPU one, CUDA asked only for other memory (registered, mapped files). A block
// of the CPU allocator that someone registered with CUDA later answers no: the
// callers treat that as pageable (staged through pinned memory, or an FSDP2
// hook run rather than skipped), slower but correct.
bool pinned_host(const at::Tensor& t);

}  // namespace coalesced_bcast

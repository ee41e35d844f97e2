#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "copy_table.h"

namespace coalesced_bcast {

// One launch copying a whole bucket between the ring slot and the tensors that
// the bucket's runs (the table device-resident, sorted by bucket offset) point
// at: device memory, or page-locked host memory that the kernel reads over the
// bus. Contiguous runs of skip_min bytes or more are left out (the caller
// copies them another way).
void launch_copy_bucket(
    uint8_t* bucket,
    int64_t nbytes,
    const CopyOp* ops,
    int64_t num_ops,
    const Layout* layouts,
    bool pack,
    cudaStream_t stream,
    int64_t skip_min = INT64_MAX);

// One launch of a bucket's cast copies (ScatterOp runs, device-resident):
// each reads src_base + bucket_offset and writes dst_base + dst_ptr (a load:
// the slot and 0; a refit's pack: 0 and its chunk or slot); `chunks` is the
// sum of the runs' chunks.
void launch_scatter_bucket(
    uintptr_t src_base,
    uintptr_t dst_base,
    const ScatterOp* ops,
    int64_t num_ops,
    int64_t chunks,
    const Box* boxes,
    cudaStream_t stream);

}  // namespace coalesced_bcast

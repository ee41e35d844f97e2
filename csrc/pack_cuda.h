#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "copy_table.h"

namespace coalesced_bcast {

// One launch copying a whole bucket between the ring slot and the tensors that
// the bucket's runs (device-resident, sorted by bucket offset) point at.
void launch_copy_bucket(
    uint8_t* bucket,
    int64_t nbytes,
    const CopyOp* ops,
    int64_t num_ops,
    const Layout* layouts,
    bool pack,
    cudaStream_t stream);

// One launch writing a load's bucket into this rank's shards: `ops` (device-
// resident) are the bucket's scatter runs, `chunks` the sum of their chunks.
void launch_scatter_bucket(
    const uint8_t* bucket,
    const ScatterOp* ops,
    int64_t num_ops,
    int64_t chunks,
    const Box* boxes,
    cudaStream_t stream);

}  // namespace coalesced_bcast

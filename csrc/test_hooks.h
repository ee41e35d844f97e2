// test_hooks: fault injection for the tests, exposed by the bindings as private
// `_C._test_*` functions. Nothing in the library sets them.
#pragma once

namespace coalesced_bcast {

// Makes the next batched host read (host_reads_cuda.cu) pass arguments the CUDA runtime refuses, so that
// the fallback for a driver without cudaMemcpyBatchAsync runs on one that has it: the copy kernel then
// reads every small pinned run, in this process from then on. false withdraws a refusal not yet taken.
void test_refuse_next_host_batch(bool refuse);

// Whether a refusal is pending; takes it (the next call answers false).
bool take_host_batch_refusal();

}  // namespace coalesced_bcast

// The states the benchmark broadcasts, and the bitwise check of a result.
// Every rank builds the same structure from the same spec; values come from a
// counter-based hash of (seed, tensor, element of its integer view), so any
// rank can recompute what the source holds without receiving it.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

namespace perf {

enum class Dist {
  kUniform,  // -t N tensors of one dtype, equal sizes
  kSmall,    // sizes as in the anchors: bf16, 256..65535 elements, one per 64 KiB of state
  kLlama,    // the Llama-3-8B list (291 tensors), every dim scaled by sqrt(bytes / 14.96 GiB)
  kMixed,    // every dtype, 0-dim, empty, strided views, aliases, tensors larger than a bucket
};

struct StateSpec {
  Dist dist = Dist::kLlama;
  int64_t bytes = 0;        // requested state size; the built state is close to it
  int64_t tensors = 1;      // kUniform
  at::ScalarType dtype = at::kBFloat16;  // kUniform
  uint64_t structure_seed = 1;  // kMixed: which tensors
  int64_t bucket_bytes = 16 << 20;      // kMixed sizes some tensors relative to these
  int64_t inplace_min_bytes = 4 << 20;
};

struct State {
  std::vector<at::Tensor> tensors;   // what is planned, aliases included
  std::vector<std::string> names;
  std::vector<int64_t> owner;        // tensors[i] holds the values of tensor owner[i]
  int64_t bytes = 0;                 // over distinct tensors
  int64_t elements = 0;              // over distinct tensors
  std::string type;                  // a dtype name, or "mixed"
};

Dist parse_dist(const std::string& name);
std::string dist_name(Dist d);
at::ScalarType parse_dtype(const std::string& name);
std::string dtype_name(at::ScalarType t);

State make_state(const StateSpec& spec, at::Device device);

// Source values: tensor i holds ref(seed, owner[i]) in logical element order.
void fill(const State& s, uint64_t seed);
// Every element made different from its expected value, so that any element a
// broadcast fails to write is counted.
void poison(const State& s, uint64_t seed);
// Elements (of every tensor, aliases included) that differ from the expected
// values, counted in each dtype's integer view (a complex128 element is two
// int64 words); `first_bad` gets a description of the first wrong tensor.
int64_t count_wrong(const State& s, uint64_t seed, int64_t rank, std::string* first_bad);
// Flips one byte of the last non-empty tensor: what --inject-fault does.
void corrupt_one(const State& s);

// "1M" -> 1048576; K, M, G, T are powers of 1024.
int64_t parse_bytes(const std::string& text);
std::string format_bytes(int64_t bytes);

}  // namespace perf

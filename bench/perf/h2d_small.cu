// Many small pinned host buffers -> one device buffer, three ways: a copy-engine copy per buffer
// (cudaMemcpyAsync), the copy engine fed a batch (cudaMemcpyBatchAsync, CUDA 12.8+), and a kernel reading
// host memory over the bus (what pack_cuda.cu does for a bucket's small pinned runs); beside one copy of the
// same bytes from one pinned buffer; and the kernel reading half the buffers while the copy engine copies
// the other half's bytes from one buffer on a second stream (whether the kernel alone leaves the bus idle:
// then a load could send part of its small runs through a staged copy beside the kernel); last, a 16k-key
// load's mix of sizes (mixed_case: the kernel beside the copy engine fed in batches). Prints the host time of
// the enqueue and the device time, best of -n.
//   nvcc -O2 -std=c++17 -arch=sm_90 bench/perf/h2d_small.cu -o /tmp/h2d_small && /tmp/h2d_small [-n 5]
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

#define CK(x)                                                                                    \
  do {                                                                                           \
    cudaError_t e_ = (x);                                                                        \
    if (e_ != cudaSuccess) {                                                                     \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                              \
    }                                                                                            \
  } while (0)

struct Run {
  const uint4* src;
  uint4* dst;
  long long words;
};

// One block per run: each thread keeps kLoads 16-byte words in flight before storing any.
template <int kLoads>
__global__ void gather(const Run* runs) {
  const Run r = runs[blockIdx.x];
  for (long long base = 0; base < r.words; base += (long long)blockDim.x * kLoads) {
    uint4 v[kLoads];
#pragma unroll
    for (int j = 0; j < kLoads; ++j) {
      const long long w = base + threadIdx.x + (long long)j * blockDim.x;
      if (w < r.words) v[j] = r.src[w];
    }
#pragma unroll
    for (int j = 0; j < kLoads; ++j) {
      const long long w = base + threadIdx.x + (long long)j * blockDim.x;
      if (w < r.words) r.dst[w] = v[j];
    }
  }
}

static double now_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// The best host enqueue time and device time (ms) of `enqueue` over reps runs after a warm-up, the device
// buffer poisoned before each.
struct Best {
  double host_ms = 1e30, dev_ms = 1e30;
};
static Best best_of(int reps, char* dev, size_t total, cudaStream_t s, cudaEvent_t a, cudaEvent_t b,
                    const std::function<void()>& enqueue) {
  Best best;
  for (int r = 0; r < reps + 1; ++r) {
    CK(cudaMemsetAsync(dev, 0xff, total, s));
    CK(cudaStreamSynchronize(s));
    CK(cudaEventRecord(a, s));
    const double t0 = now_ms();
    enqueue();
    const double t1 = now_ms();
    CK(cudaEventRecord(b, s));
    CK(cudaEventSynchronize(b));
    CK(cudaGetLastError());
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    if (r > 0) {  // the first is a warm-up
      best.host_ms = std::min(best.host_ms, t1 - t0);
      best.dev_ms = std::min(best.dev_ms, (double)ms);
    }
  }
  return best;
}

#if CUDART_VERSION >= 12080
// n copies through the copy engine in one cudaMemcpyBatchAsync (its signature as of CUDA 13.0, or 12.8's).
static void batch_copy(void** dsts, const void** srcs, size_t* sizes, size_t n, cudaStream_t st,
                       cudaMemcpySrcAccessOrder order = cudaMemcpySrcAccessOrderStream) {
  cudaMemcpyAttributes attr{};
  attr.srcAccessOrder = order;
  size_t idx = 0;
#if CUDART_VERSION >= 13000
  CK(cudaMemcpyBatchAsync(dsts, srcs, sizes, n, &attr, &idx, 1, st));
#else
  size_t fail = 0;
  CK(cudaMemcpyBatchAsync(dsts, const_cast<void**>(srcs), sizes, n, &attr, &idx, 1, &fail, st));
#endif
}
#endif

// A 16k-key load's shape (bench/load_calls.py): 16,384 pinned buffers of 256-65,535 bf16 elements (512 B to
// 128 KiB, rounded up to 16 bytes), each its own allocation, back to back into one device buffer. The kernel
// over all of them; the kernel over the buffers under T while the copy engine, fed by cudaMemcpyBatchAsync 512
// buffers a call, copies those of >= T on a second stream; the batch over all.
static void mixed_case(int reps, cudaStream_t s, cudaStream_t s2, cudaEvent_t a, cudaEvent_t b, cudaEvent_t fork,
                       cudaEvent_t join) {
  const size_t n = 16384;
  std::vector<size_t> sizes(n), offsets(n);
  unsigned long long x = 0;
  size_t total = 0;
  for (size_t i = 0; i < n; ++i) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    const size_t elems = 256 + (x >> 33) % (65536 - 256);
    sizes[i] = (elems * 2 + 15) / 16 * 16;
    offsets[i] = total;
    total += sizes[i];
  }
  std::vector<void*> host(n);
  for (size_t i = 0; i < n; ++i) {
    CK(cudaHostAlloc(&host[i], sizes[i], cudaHostAllocDefault));
    for (size_t k = 0; k < sizes[i] / 8; ++k) static_cast<unsigned long long*>(host[i])[k] = i * 1000003ull + k;
  }
  char* dev = nullptr;
  CK(cudaMalloc(&dev, total));
  std::vector<unsigned long long> back(total / 8);
  // The runs of one subset (under T, or all) for the kernel, uploaded once per subset.
  auto runs_of = [&](size_t below, size_t* count) {
    std::vector<Run> runs;
    for (size_t i = 0; i < n; ++i)
      if (sizes[i] < below)
        runs.push_back(Run{static_cast<const uint4*>(host[i]), reinterpret_cast<uint4*>(dev + offsets[i]),
                           (long long)(sizes[i] / 16)});
    Run* d = nullptr;
    CK(cudaMalloc(&d, std::max<size_t>(1, runs.size()) * sizeof(Run)));
    if (!runs.empty()) CK(cudaMemcpy(d, runs.data(), runs.size() * sizeof(Run), cudaMemcpyHostToDevice));
    *count = runs.size();
    return d;
  };
  auto time = [&](const char* name, const std::function<void()>& enqueue) {
    const Best best = best_of(reps, dev, total, s, a, b, enqueue);
    long long wrong = 0;
    CK(cudaMemcpy(back.data(), dev, total, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < n; ++i)
      for (size_t k = 0; k < sizes[i] / 8; ++k) wrong += back[offsets[i] / 8 + k] != i * 1000003ull + k;
    std::printf("%10s %8zu %-28s %10.2f %10.2f %9.1f %7lld\n", "mixed", n, name, best.host_ms, best.dev_ms,
                total / best.dev_ms / 1e6, wrong);
    std::fflush(stdout);
  };
  size_t all_count = 0;
  Run* all_runs = runs_of(~size_t(0), &all_count);
  time("kernel 256 thr x 8 loads", [&] { gather<8><<<all_count, 256, 0, s>>>(all_runs); });
#if CUDART_VERSION >= 12080
  for (size_t t : {(size_t)16 << 10, (size_t)32 << 10, (size_t)64 << 10, ~size_t(0)}) {
    const bool alone = t == ~size_t(0);
    size_t small_count = 0;
    Run* small = runs_of(alone ? 0 : t, &small_count);
    std::vector<void*> dsts;
    std::vector<const void*> srcs;
    std::vector<size_t> lens;
    for (size_t i = 0; i < n; ++i)
      if (alone || sizes[i] >= t) {
        dsts.push_back(dev + offsets[i]);
        srcs.push_back(host[i]);
        lens.push_back(sizes[i]);
      }
    char name[64];
    if (alone) {
      std::snprintf(name, sizeof name, "batch all, 512 a call");
    } else {
      std::snprintf(name, sizeof name, "kernel < %zuK + batch >= (%zu)", t >> 10, dsts.size());
    }
    time(name, [&] {
      cudaStream_t on = alone ? s : s2;  // alone: every buffer through the copy engine, on s itself
      if (!alone) {
        CK(cudaEventRecord(fork, s));
        CK(cudaStreamWaitEvent(s2, fork, 0));
        if (small_count) gather<8><<<small_count, 256, 0, s>>>(small);
      }
      for (size_t lo = 0; lo < dsts.size(); lo += 512)
        batch_copy(dsts.data() + lo, srcs.data() + lo, lens.data() + lo, std::min<size_t>(512, dsts.size() - lo), on);
      if (!alone) {
        CK(cudaEventRecord(join, s2));
        CK(cudaStreamWaitEvent(s, join, 0));
      }
    });
    CK(cudaFree(small));
  }
#endif
  CK(cudaFree(all_runs));
  CK(cudaFree(dev));
  for (void* p : host) CK(cudaFreeHost(p));
}

int main(int argc, char** argv) {
  int reps = 5;
  for (int i = 1; i + 1 < argc; ++i)
    if (!std::strcmp(argv[i], "-n")) reps = std::atoi(argv[i + 1]);
  int rt = 0;
  CK(cudaRuntimeGetVersion(&rt));
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("# %s, CUDA runtime %d\n", prop.name, rt);
  std::printf("%10s %8s %-28s %10s %10s %9s %7s\n", "run_bytes", "count", "method", "enqueue_ms", "device_ms", "GB/s",
              "wrong");
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaStream_t s2;
  CK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  cudaEvent_t a, b, fork, join;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  CK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
  CK(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
  const long long cases[][2] = {{4 << 10, 16384}, {64 << 10, 16384}, {16 << 10, 65536}, {1 << 20, 1024}};
  for (const auto& c : cases) {
    const size_t size = c[0];
    const size_t n = c[1];
    const size_t total = size * n;
    std::vector<void*> host(n);
    for (size_t i = 0; i < n; ++i) {
      CK(cudaHostAlloc(&host[i], size, cudaHostAllocDefault));
      for (size_t k = 0; k < size / 8; ++k) static_cast<unsigned long long*>(host[i])[k] = i * 1000003ull + k;
    }
    void* one = nullptr;
    CK(cudaHostAlloc(&one, total, cudaHostAllocDefault));
    for (size_t i = 0; i < n; ++i) std::memcpy(static_cast<char*>(one) + i * size, host[i], size);
    char* dev = nullptr;
    CK(cudaMalloc(&dev, total));
    std::vector<void*> dsts(n);
    std::vector<const void*> srcs(n);
    std::vector<size_t> sizes(n, size);
    std::vector<Run> runs(n);
    for (size_t i = 0; i < n; ++i) {
      dsts[i] = dev + i * size;
      srcs[i] = host[i];
      runs[i] = Run{static_cast<const uint4*>(host[i]), reinterpret_cast<uint4*>(dev + i * size),
                    (long long)(size / 16)};
    }
    Run* druns = nullptr;
    CK(cudaMalloc(&druns, n * sizeof(Run)));
    CK(cudaMemcpy(druns, runs.data(), n * sizeof(Run), cudaMemcpyHostToDevice));
    std::vector<unsigned long long> back(total / 8);

    auto time = [&](const char* name, const std::function<void()>& enqueue, bool check, size_t bytes = 0) {
      const Best best = best_of(reps, dev, total, s, a, b, enqueue);
      long long wrong = 0;
      if (check) {
        CK(cudaMemcpy(back.data(), dev, total, cudaMemcpyDeviceToHost));
        for (size_t i = 0; i < n; ++i)
          for (size_t k = 0; k < size / 8; ++k) wrong += back[i * (size / 8) + k] != i * 1000003ull + k;
      }
      std::printf("%10zu %8zu %-28s %10.2f %10.2f %9.1f %7lld\n", size, n, name, best.host_ms, best.dev_ms,
                  (bytes ? bytes : total) / best.dev_ms / 1e6, wrong);
      std::fflush(stdout);
    };

    time("one copy, one buffer", [&] { CK(cudaMemcpyAsync(dev, one, total, cudaMemcpyHostToDevice, s)); }, true);
    time("copy per buffer", [&] {
      for (size_t i = 0; i < n; ++i) CK(cudaMemcpyAsync(dsts[i], srcs[i], size, cudaMemcpyHostToDevice, s));
    }, true);
#if CUDART_VERSION >= 12080
    for (int order : {(int)cudaMemcpySrcAccessOrderStream, (int)cudaMemcpySrcAccessOrderAny}) {
      for (size_t chunk : {n, (size_t)std::max<size_t>(1, (32u << 20) / size)}) {
        char name[64];
        std::snprintf(name, sizeof name, "batch %s, %zu a call", order == cudaMemcpySrcAccessOrderAny ? "any" : "stream",
                      std::min(chunk, n));
        time(name, [&] {
          for (size_t lo = 0; lo < n; lo += chunk)
            batch_copy(dsts.data() + lo, srcs.data() + lo, sizes.data() + lo, std::min(chunk, n - lo), s,
                       static_cast<cudaMemcpySrcAccessOrder>(order));
        }, true);
      }
    }
#endif
    time("kernel 512 thr x 2 loads", [&] { gather<2><<<n, 512, 0, s>>>(druns); }, true);
    time("kernel 256 thr x 8 loads", [&] { gather<8><<<n, 256, 0, s>>>(druns); }, true);
    time("kernel 1024 thr x 4 loads", [&] { gather<4><<<n, 1024, 0, s>>>(druns); }, true);
    // Half the runs by the kernel, the other half's bytes (laid out as the kernel would write them) by one
    // copy of the one-buffer copy's second half on s2, both between the same events.
    const size_t half = n / 2;
    time("kernel half + copy half", [&] {
      CK(cudaEventRecord(fork, s));
      CK(cudaStreamWaitEvent(s2, fork, 0));
      gather<8><<<half, 256, 0, s>>>(druns);
      CK(cudaMemcpyAsync(dev + half * size, static_cast<char*>(one) + half * size, (n - half) * size,
                         cudaMemcpyHostToDevice, s2));
      CK(cudaEventRecord(join, s2));
      CK(cudaStreamWaitEvent(s, join, 0));
    }, true);
    time("kernel half alone", [&] { gather<8><<<half, 256, 0, s>>>(druns); }, false, half * size);
    CK(cudaFree(druns));
    CK(cudaFree(dev));
    CK(cudaFreeHost(one));
    for (void* p : host) CK(cudaFreeHost(p));
  }
  mixed_case(reps, s, s2, a, b, fork, join);
  return 0;
}

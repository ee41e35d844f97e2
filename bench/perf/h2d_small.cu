// Many small pinned host buffers -> one device buffer, three ways: a copy-engine copy per buffer
// (cudaMemcpyAsync), the copy engine fed a batch (cudaMemcpyBatchAsync, CUDA 12.8+), and a kernel reading
// host memory over the bus (what pack_cuda.cu does for a bucket's small pinned runs); beside one copy of the
// same bytes from one pinned buffer; and the kernel reading half the buffers while the copy engine copies
// the other half's bytes from one buffer on a second stream (whether the kernel alone leaves the bus idle:
// then a load could send part of its small runs through a staged copy beside the kernel). Prints the host
// time of the enqueue and the device time, best of -n.
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
      double best_host = 1e30, best_dev = 1e30;
      long long wrong = 0;
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
          best_host = std::min(best_host, t1 - t0);
          best_dev = std::min(best_dev, (double)ms);
        }
      }
      if (check) {
        CK(cudaMemcpy(back.data(), dev, total, cudaMemcpyDeviceToHost));
        for (size_t i = 0; i < n; ++i)
          for (size_t k = 0; k < size / 8; ++k) wrong += back[i * (size / 8) + k] != i * 1000003ull + k;
      }
      std::printf("%10zu %8zu %-28s %10.2f %10.2f %9.1f %7lld\n", size, n, name, best_host, best_dev,
                  (bytes ? bytes : total) / best_dev / 1e6, wrong);
      std::fflush(stdout);
    };

    time("one copy, one buffer", [&] { CK(cudaMemcpyAsync(dev, one, total, cudaMemcpyHostToDevice, s)); }, true);
    time("copy per buffer", [&] {
      for (size_t i = 0; i < n; ++i) CK(cudaMemcpyAsync(dsts[i], srcs[i], size, cudaMemcpyHostToDevice, s));
    }, true);
#if CUDART_VERSION >= 12080
    for (int order : {(int)cudaMemcpySrcAccessOrderStream, (int)cudaMemcpySrcAccessOrderAny}) {
      for (size_t chunk : {n, (size_t)std::max<size_t>(1, (32u << 20) / size)}) {
        cudaMemcpyAttributes attr{};
        attr.srcAccessOrder = static_cast<cudaMemcpySrcAccessOrder>(order);
        size_t idx = 0;
        char name[64];
        std::snprintf(name, sizeof name, "batch %s, %zu a call", order == cudaMemcpySrcAccessOrderAny ? "any" : "stream",
                      std::min(chunk, n));
        time(name, [&] {
          for (size_t lo = 0; lo < n; lo += chunk) {
            const size_t cnt = std::min(chunk, n - lo);
#if CUDART_VERSION >= 13000
            CK(cudaMemcpyBatchAsync(dsts.data() + lo, srcs.data() + lo, sizes.data() + lo, cnt, &attr, &idx, 1, s));
#else
            size_t fail = 0;
            CK(cudaMemcpyBatchAsync(dsts.data() + lo, const_cast<void**>(srcs.data() + lo), sizes.data() + lo, cnt,
                                    &attr, &idx, 1, &fail, s));
#endif
          }
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
  return 0;
}

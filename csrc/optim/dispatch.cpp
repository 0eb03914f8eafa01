// Run-time ISA choice and the static multithreaded split of one flat range.
#include <algorithm>
#include <atomic>

#include "optim/kernels.h"
#include "optim/thread_pool.h"

namespace luwu::optim {
namespace {

// Below this many elements per thread, a second thread costs more than it
// gives: one thread alone moves ~90% of what the memory allows (fp32 AdamW,
// ~1.7 G params/s on the 2-core reference machine), while handing a call to
// another thread costs tens of microseconds on a busy machine. Measured there
// under load: 1 MiB calls 1343 M params/s on one thread vs 742 on two; 4 MiB
// calls 1721 vs 1504; 64 MiB and up, two threads win or tie.
constexpr int64_t kMinPerThread = 1 << 20;
// Block boundaries are multiples of 16 fp32 elements (64 bytes), so two threads
// never write the same cache line and every block starts vector-aligned.
constexpr int64_t kSplitAlign = 16;
// Blocks per thread. [Note: dynamic blocks] The range is cut into a few blocks
// per thread that the threads claim from an atomic counter, instead of one
// fixed slice each: on a shared machine a thread whose core is busy with
// another process simply claims fewer blocks, where a static split would make
// every call wait for that straggler. Blocks stay large (>= 1 Mi elements),
// so each is a long sequential sweep and the claims cost nothing.
constexpr int64_t kBlocksPerThread = 8;

template <class Args>
struct Job {
  const Args* args;
  void (*fn)(const Args&, int64_t, int64_t);
  int64_t numel;
  int64_t block;
  std::atomic<int64_t> next{0};
};

template <class Args>
void job_task(void* ctx, int /*index*/, int /*count*/) {
  auto* job = static_cast<Job<Args>*>(ctx);
  for (;;) {
    const int64_t begin = job->next.fetch_add(job->block, std::memory_order_relaxed);
    if (begin >= job->numel) return;
    job->fn(*job->args, begin, std::min(job->numel, begin + job->block));
  }
}

template <class Args>
void run_split(const Args& a, int64_t numel, int num_threads, void (*fn)(const Args&, int64_t, int64_t)) {
  if (numel <= 0) return;
  const int64_t useful = std::max<int64_t>(1, numel / kMinPerThread);
  const int64_t wanted = std::min<int64_t>({num_threads, useful, ThreadPool::kMaxThreads});
  const int count = static_cast<int>(std::max<int64_t>(1, wanted));
  if (count == 1) {
    fn(a, 0, numel);
    return;
  }
  int64_t block = std::max<int64_t>(kMinPerThread, numel / (count * kBlocksPerThread));
  block = (block + kSplitAlign - 1) / kSplitAlign * kSplitAlign;
  Job<Args> job;
  job.args = &a;
  job.fn = fn;
  job.numel = numel;
  job.block = block;
  ThreadPool::instance().run(count, job_task<Args>, &job);
}

}  // namespace

bool isa_supported(Isa isa) {
  switch (isa) {
    case Isa::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && isa_supported(Isa::kAvx2);
    case Isa::kAvx2:
      // Every AVX2 CPU also has F16C, which the half conversions use.
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case Isa::kScalar:
      return true;
  }
  return false;
}

Isa best_isa() {
  static const Isa best = isa_supported(Isa::kAvx512) ? Isa::kAvx512
                          : isa_supported(Isa::kAvx2) ? Isa::kAvx2
                                                      : Isa::kScalar;
  return best;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    case Isa::kScalar: return "scalar";
  }
  return "?";
}

void run_adam(const AdamArgs& a, int64_t numel, Isa isa, int num_threads) {
  auto fn = isa == Isa::kAvx512 ? avx512::adam : isa == Isa::kAvx2 ? avx2::adam : scalar::adam;
  run_split(a, numel, num_threads, fn);
}

void run_sgd(const SgdArgs& a, int64_t numel, Isa isa, int num_threads) {
  auto fn = isa == Isa::kAvx512 ? avx512::sgd : isa == Isa::kAvx2 ? avx2::sgd : scalar::sgd;
  run_split(a, numel, num_threads, fn);
}

void run_probe(const ProbeArgs& a, int64_t numel, Isa isa, int num_threads) {
  auto fn = isa == Isa::kAvx512 ? avx512::probe : isa == Isa::kAvx2 ? avx2::probe : scalar::probe;
  run_split(a, numel, num_threads, fn);
}

}  // namespace luwu::optim

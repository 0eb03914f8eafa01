// A small persistent pool of pinned worker threads for the optimizer kernels.
//
// [Note: why not OpenMP] torch's CPU wheel ships its own libgomp and runs its
// ops on it; linking the system libgomp into _C as well would give the process
// two OpenMP runtimes, each sizing its team to all cores, which oversubscribes
// the CPU when a torch op and an optimizer step overlap (and the two runtimes'
// spin-waits fight each other). The kernels only need to split one flat range,
// so a few persistent threads (created once, pinned, woken through a
// generation counter) give the same parallelism with no second runtime and no
// per-call thread creation or allocation.
//
// [Note: short spin] The store calls the kernels on 1-64 MiB chunks back to
// back, ~0.1-30 ms each. A worker that went to sleep on a futex takes tens of
// microseconds to be scheduled again, which is ~15% of a 1 MiB call, so after
// each task a worker (and the caller waiting for the workers) first polls for
// a bounded time (50 us by default) before blocking; idle threads still end up asleep.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>

namespace luwu::optim {

class ThreadPool {
 public:
  using Task = void (*)(void* ctx, int index, int count);

  // The process-wide pool (recreated in a forked child, whose threads are gone).
  static ThreadPool& instance();

  // Runs task(ctx, i, count) for every i in [0, count): i = 0 on the calling
  // thread, the others on workers; returns when all are done. Callers from
  // several threads are serialised.
  void run(int count, Task task, void* ctx);

  // How long a thread polls before it sleeps ([Note: short spin]); 0 sleeps at once.
  void set_spin_micros(int64_t micros) { spin_micros_.store(micros, std::memory_order_relaxed); }

 private:
  static constexpr int64_t kDefaultSpinMicros = 50;
  static constexpr int kCountBits = 8;
  static constexpr uint64_t kCountMask = (1u << kCountBits) - 1;

 public:
  static constexpr int kMaxThreads = static_cast<int>(kCountMask);

 private:

  void ensure_workers(int num_workers);
  void worker_main(int index, uint64_t seen);
  uint64_t wait_generation(uint64_t seen);
  void wait_done();

  std::mutex run_mu_;  // one run() at a time: the task slots below are shared
  std::mutex mu_;      // pairs with the condition variables (sleeping phase only)
  std::condition_variable wake_;
  std::condition_variable done_;
  int num_workers_ = 0;  // guarded by run_mu_
  // (generation << kCountBits) | thread count of the run. A run writes task_,
  // ctx_ and pending_, then publishes a new generation (release); a worker
  // that sees it (acquire) and takes part reads them.
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  std::atomic<int64_t> spin_micros_{kDefaultSpinMicros};
  Task task_ = nullptr;
  void* ctx_ = nullptr;
};

}  // namespace luwu::optim

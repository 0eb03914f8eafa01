// A small persistent pool of pinned worker threads for the optimizer kernels.
//
// [Note: why not OpenMP] torch's CPU wheel ships its own libgomp and runs its
// ops on it; linking the system libgomp into _C as well would give the process
// two OpenMP runtimes, each sizing its team to all cores, which oversubscribes
// the CPU when a torch op and an optimizer step overlap (and the two runtimes'
// spin-waits fight each other). The kernels only need to split one
// flat range, so a few persistent threads (created once, pinned, woken by a
// condition variable) give the same parallelism with no second runtime and no
// per-call thread creation or allocation.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>

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

 private:
  void ensure_workers(int num_workers);
  void worker_main(int index, uint64_t seen);

  std::mutex run_mu_;  // one run() at a time: the task slots below are shared
  std::mutex mu_;      // guards every field below
  std::condition_variable wake_;
  std::condition_variable done_;
  int num_workers_ = 0;
  uint64_t generation_ = 0;
  int active_ = 0;
  int pending_ = 0;
  Task task_ = nullptr;
  void* ctx_ = nullptr;
};

}  // namespace luwu::optim

#include "optim/thread_pool.h"

#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include <cassert>
#include <chrono>
#include <thread>

namespace luwu::optim {
namespace {

ThreadPool* g_pool = nullptr;
pid_t g_pool_pid = 0;
std::mutex g_pool_mu;

// The index-th CPU of the process's affinity mask, or -1.
int nth_allowed_cpu(int index) {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) != 0) return -1;
  const int allowed = CPU_COUNT(&set);
  if (allowed <= 0) return -1;
  int wanted = index % allowed;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (CPU_ISSET(cpu, &set) && wanted-- == 0) return cpu;
  }
  return -1;
}

}  // namespace

ThreadPool& ThreadPool::instance() {
  std::lock_guard<std::mutex> lock(g_pool_mu);
  // The pool is never destroyed: destroying joinable std::threads at exit would
  // terminate the process, and a forked child has a copy whose threads do not
  // exist (so it gets a fresh pool and leaks the copy).
  if (g_pool == nullptr || g_pool_pid != getpid()) {
    g_pool = new ThreadPool();
    g_pool_pid = getpid();
  }
  return *g_pool;
}

void ThreadPool::ensure_workers(int num_workers) {
  while (num_workers_ < num_workers) {
    const int index = num_workers_ + 1;
    // The worker starts from the current generation, so the run about to be
    // published is one it will pick up.
    std::thread worker([this, index, seen = generation_.load()] { worker_main(index, seen); });
    // Pin worker i to the i-th allowed CPU (the caller is left where the OS
    // put it), so workers never pile onto one core and a block's sweep stays
    // on the core that started it; the dynamic blocks (dispatch.cpp) absorb a
    // core that is busy with something else.
    const int cpu = nth_allowed_cpu(index);
    if (cpu >= 0) {
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(cpu, &set);
      // Best effort: a container may forbid it, and the kernels are correct either way.
      (void)pthread_setaffinity_np(worker.native_handle(), sizeof set, &set);
    }
    worker.detach();  // lives as long as the process, see instance()
    ++num_workers_;
  }
}

namespace {

// Polls pred() for up to `micros` microseconds ([Note: short spin]).
template <class Pred>
bool spin_until(Pred pred, int64_t micros) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::microseconds(micros);
  for (;;) {
    for (int i = 0; i < 64; ++i) {
      if (pred()) return true;
      __builtin_ia32_pause();
    }
    if (std::chrono::steady_clock::now() >= deadline) return pred();
  }
}

}  // namespace

uint64_t ThreadPool::wait_generation(uint64_t seen) {
  auto changed = [&] { return generation_.load(std::memory_order_acquire) != seen; };
  if (!spin_until(changed, spin_micros_.load(std::memory_order_relaxed))) {
    std::unique_lock<std::mutex> lock(mu_);
    wake_.wait(lock, changed);
  }
  return generation_.load(std::memory_order_acquire);
}

void ThreadPool::wait_done() {
  auto done = [&] { return pending_.load(std::memory_order_acquire) == 0; };
  if (!spin_until(done, spin_micros_.load(std::memory_order_relaxed))) {
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, done);
  }
}

void ThreadPool::worker_main(int index, uint64_t seen) {
  for (;;) {
    seen = wait_generation(seen);
    // The run's thread count travels in the same word as its generation: a
    // worker that takes no part reads nothing else, so it cannot race with the
    // next run's publication. A worker that slept through several runs has
    // nothing to do for the old ones: each run waits for its workers.
    const int count = static_cast<int>(seen & kCountMask);
    if (index >= count) continue;
    task_(ctx_, index, count);
    if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      // Taking the lock orders this notify after the caller's predicate check.
      std::lock_guard<std::mutex> lock(mu_);
      done_.notify_one();
    }
  }
}

void ThreadPool::run(int count, Task task, void* ctx) {
  if (count <= 1) {
    task(ctx, 0, 1);
    return;
  }
  std::lock_guard<std::mutex> run_lock(run_mu_);
  ensure_workers(count - 1);
  assert(count <= static_cast<int>(kCountMask));
  task_ = task;
  ctx_ = ctx;
  pending_.store(count - 1, std::memory_order_relaxed);
  {
    // Under mu_ so a worker between its predicate check and its sleep cannot miss it.
    std::lock_guard<std::mutex> lock(mu_);
    const uint64_t next = ((generation_.load(std::memory_order_relaxed) >> kCountBits) + 1) << kCountBits;
    generation_.store(next | static_cast<uint64_t>(count), std::memory_order_release);
  }
  wake_.notify_all();
  task(ctx, 0, count);
  wait_done();
}

}  // namespace luwu::optim

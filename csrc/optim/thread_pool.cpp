#include "optim/thread_pool.h"

#include <pthread.h>
#include <sched.h>
#include <unistd.h>

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
    // published (under the same lock) is one it will pick up.
    std::thread worker([this, index, seen = generation_] { worker_main(index, seen); });
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

void ThreadPool::worker_main(int index, uint64_t seen) {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    wake_.wait(lock, [&] { return generation_ != seen; });
    seen = generation_;
    if (index >= active_) continue;
    const Task task = task_;
    void* ctx = ctx_;
    const int count = active_;
    lock.unlock();
    task(ctx, index, count);
    lock.lock();
    if (--pending_ == 0) done_.notify_one();
  }
}

void ThreadPool::run(int count, Task task, void* ctx) {
  if (count <= 1) {
    task(ctx, 0, 1);
    return;
  }
  std::lock_guard<std::mutex> run_lock(run_mu_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    ensure_workers(count - 1);
    task_ = task;
    ctx_ = ctx;
    active_ = count;
    pending_ = count - 1;
    ++generation_;
  }
  wake_.notify_all();
  task(ctx, 0, count);
  std::unique_lock<std::mutex> lock(mu_);
  done_.wait(lock, [&] { return pending_ == 0; });
}

}  // namespace luwu::optim

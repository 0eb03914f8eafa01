// Thread-pool lane: blocking pread/pwrite/fdatasync on worker threads, for
// systems where io_uring is unavailable (seccomp in many containers).
#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <thread>
#include <vector>

#include "io/engine.h"

namespace luwu::io {
namespace {

int64_t run_piece(const Piece& p) {
  const Request& r = *p.req;
  if (p.sync) return fdatasync(r.file->buffered_fd) == 0 ? 0 : -errno;
  const int fd = piece_fd(p);
  char* addr = r.buf + p.pos;
  const off_t off = static_cast<off_t>(r.offset + p.pos);
  const ssize_t n = r.op == Op::kRead ? pread(fd, addr, p.len, off) : pwrite(fd, addr, p.len, off);
  return n >= 0 ? n : -errno;
}

class ThreadLane final : public Lane {
 public:
  ThreadLane(Engine* engine, unsigned queue_depth, uint64_t block_bytes, unsigned num_threads)
      : engine_(engine), queue_depth_(queue_depth), block_bytes_(block_bytes) {
    for (unsigned i = 0; i < num_threads; ++i) workers_.emplace_back([this] { loop(); });
  }
  ~ThreadLane() override { shutdown(); }

  void enqueue(std::shared_ptr<Request> r) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      pending_.push_back(std::move(r));
    }
    cv_.notify_one();
  }

  void shutdown() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) {
      if (t.joinable()) t.join();
    }
    workers_.clear();
  }

 private:
  void loop() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      Piece p;
      cv_.wait(lock, [&] { return stop_ || (inflight_ < queue_depth_ && !pending_.empty()); });
      if (!take_piece(&pending_, block_bytes_, &p)) {
        if (stop_) return;
        continue;
      }
      // enqueue() woke one worker; each taker wakes the next while pieces
      // remain, so a large request fans out over the whole pool.
      if (!pending_.empty()) cv_.notify_one();
      for (;;) {
        ++inflight_;
        lock.unlock();
        while (account(&p, run_piece(p)) == Step::kRetry) {
        }
        lock.lock();
        --inflight_;
        --p.req->inflight;
        const After next = after_piece(p.req);
        if (next == After::kSync) {
          // The data is written: this worker runs the fdatasync as one more piece.
          p = Piece{p.req, 0, 0, true};
          continue;
        }
        if (next == After::kComplete) {
          lock.unlock();
          engine_->complete(p.req);
          lock.lock();
        }
        break;
      }
      cv_.notify_one();
    }
  }

  Engine* engine_;
  const unsigned queue_depth_;
  const uint64_t block_bytes_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Request>> pending_;
  unsigned inflight_ = 0;
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace

std::unique_ptr<Lane> make_thread_lane(Engine* engine, unsigned queue_depth, uint64_t block_bytes,
                                       unsigned num_threads) {
  return std::make_unique<ThreadLane>(engine, queue_depth, block_bytes, num_threads);
}

}  // namespace luwu::io

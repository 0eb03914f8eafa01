// io_uring lane: one ring per direction, pieces kept in flight up to the
// queue depth.
//
// [Note: ring ownership]
// One reaper thread per lane owns its ring: it alone prepares entries,
// submits and reaps, which lets the kernel run completions inside its
// io_uring_enter (SINGLE_ISSUER + DEFER_TASKRUN) rather than interrupting
// whichever thread submitted. Callers only append to `pending_` under the
// lane mutex and bump an eventfd; the ring always holds a read of that
// eventfd, so a bump completes it and wakes the reaper wherever it waits.
// The ring has queue_depth + 1 entries: the spare one is that wake-up read.
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <future>
#include <thread>
#include <vector>

#include "io/engine.h"
#include "io/uring.h"

namespace luwu::io {
namespace {

constexpr uint64_t kWakeTag = 0;  // user_data of the eventfd read; pieces are never null
// Target of every lane's eventfd read. Its value is never used, and being
// static it outlives any read the kernel might still finish during teardown.
uint64_t wake_sink = 0;

class UringLane final : public Lane {
 public:
  UringLane(Engine* engine, unsigned queue_depth, uint64_t block_bytes)
      : engine_(engine), queue_depth_(queue_depth), block_bytes_(block_bytes) {}
  ~UringLane() override {
    shutdown();
    if (wake_fd_ >= 0) ::close(wake_fd_);
  }

  int start() {
    wake_fd_ = eventfd(0, EFD_CLOEXEC);
    if (wake_fd_ < 0) return errno;
    // SINGLE_ISSUER binds the ring to the thread that creates it, so the
    // reaper sets it up itself and reports back.
    std::promise<int> setup;
    std::future<int> result = setup.get_future();
    reaper_ = std::thread([this, &setup] {
      const int err = ring_.init(queue_depth_ + 1);
      setup.set_value(-err);
      if (err == 0) reap();
    });
    const int err = result.get();
    if (err != 0) reaper_.join();
    return err;
  }

  void enqueue(std::shared_ptr<Request> r) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      pending_.push_back(std::move(r));
    }
    wake();
  }

  void shutdown() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_ || !reaper_.joinable()) return;
      stopping_ = true;
    }
    wake();
    reaper_.join();
  }

 private:
  void wake() {
    const uint64_t one = 1;
    // An eventfd write only fails on counter overflow, impossible at one per request.
    while (::write(wake_fd_, &one, sizeof(one)) < 0 && errno == EINTR) {
    }
  }

  io_uring_sqe* next_sqe() {
    io_uring_sqe* sqe = ring_.get_sqe();
    // Invariant: at most queue_depth pieces + the wake read, and the ring is that large.
    if (sqe == nullptr) std::abort();
    return sqe;
  }

  void arm_wake() {
    io_uring_sqe* sqe = next_sqe();
    sqe->opcode = IORING_OP_READ;
    sqe->fd = wake_fd_;
    sqe->addr = reinterpret_cast<uint64_t>(&wake_sink);
    sqe->len = sizeof(wake_sink);
    sqe->off = 0;
    sqe->user_data = kWakeTag;
  }

  void prep(Piece* p) {
    io_uring_sqe* sqe = next_sqe();
    const Request& r = *p->req;
    sqe->user_data = reinterpret_cast<uint64_t>(p);
    if (p->sync) {
      sqe->opcode = IORING_OP_FSYNC;
      sqe->fd = r.file->buffered_fd;
      sqe->fsync_flags = IORING_FSYNC_DATASYNC;
      return;
    }
    sqe->opcode = r.op == Op::kRead ? IORING_OP_READ : IORING_OP_WRITE;
    sqe->fd = piece_fd(*p);
    sqe->addr = reinterpret_cast<uint64_t>(r.buf + p->pos);
    sqe->len = static_cast<uint32_t>(p->len);
    sqe->off = r.offset + p->pos;
  }

  // Under mu_: one completion. Returns a request to complete, or nullptr.
  Request* on_cqe(uint64_t user_data, int32_t res) {
    if (user_data == kWakeTag) {
      arm_wake();
      return nullptr;
    }
    Piece* p = reinterpret_cast<Piece*>(user_data);
    if (account(p, res) == Step::kRetry) {
      prep(p);
      return nullptr;
    }
    Request* r = p->req;
    delete p;
    --inflight_;
    --r->inflight;
    switch (after_piece(r)) {
      case After::kSync:
        prep(new Piece{r, 0, 0, true});
        ++inflight_;
        return nullptr;
      case After::kComplete:
        return r;
      case After::kNothing:
        return nullptr;
    }
    return nullptr;
  }

  void reap() {
    std::vector<Request*> finished;
    arm_wake();
    for (;;) {
      bool exit = false;
      {
        std::lock_guard<std::mutex> lock(mu_);
        uint64_t user_data;
        int32_t res;
        while (ring_.pop_cqe(&user_data, &res)) {
          if (Request* r = on_cqe(user_data, res)) finished.push_back(r);
        }
        Piece p;
        while (inflight_ < queue_depth_ && take_piece(&pending_, block_bytes_, &p)) {
          prep(new Piece(p));
          ++inflight_;
        }
        exit = stopping_ && inflight_ == 0 && pending_.empty();
      }
      for (Request* r : finished) engine_->complete(r);
      finished.clear();
      if (exit) return;  // the pending wake read dies with the ring
      // Entries are validated before they reach the ring, so a failing
      // io_uring_enter means the ring itself broke (a bug, not an IO error).
      if (ring_.submit_and_wait() < 0) std::abort();
    }
  }

  Engine* engine_;
  const unsigned queue_depth_;
  const uint64_t block_bytes_;
  Ring ring_;
  int wake_fd_ = -1;
  std::mutex mu_;
  std::deque<std::shared_ptr<Request>> pending_;
  unsigned inflight_ = 0;
  bool stopping_ = false;
  std::thread reaper_;
};

}  // namespace

std::unique_ptr<Lane> make_uring_lane(Engine* engine, unsigned queue_depth, uint64_t block_bytes, int* err) {
  auto lane = std::make_unique<UringLane>(engine, queue_depth, block_bytes);
  *err = lane->start();
  if (*err != 0) return nullptr;
  return lane;
}

}  // namespace luwu::io

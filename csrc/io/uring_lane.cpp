// io_uring lane: one ring per direction, pieces kept in flight up to the
// queue depth, completions reaped by one thread.
//
// [Note: ring ownership]
// The submission queue is touched only under the lane mutex: callers prepare
// and submit in enqueue(), and the reaper refills after each batch of
// completions. The completion queue belongs to the reaper alone, which waits
// in io_uring_enter(GETEVENTS) without the lock, so a caller's submit never
// waits for a completion. The ring has queue_depth + 1 entries: the spare one
// carries the NOP that wakes the reaper at shutdown.
#include <cerrno>
#include <cstdlib>
#include <thread>
#include <vector>

#include "io/engine.h"
#include "io/uring.h"

namespace luwu::io {
namespace {

constexpr uint64_t kWakeTag = 0;  // user_data of the shutdown NOP; pieces are never null

class UringLane final : public Lane {
 public:
  UringLane(Engine* engine, unsigned queue_depth, uint64_t block_bytes)
      : engine_(engine), queue_depth_(queue_depth), block_bytes_(block_bytes) {}
  ~UringLane() override { shutdown(); }

  int start() {
    const int err = ring_.init(queue_depth_ + 1);
    if (err != 0) return -err;
    reaper_ = std::thread([this] { reap(); });
    return 0;
  }

  void enqueue(std::shared_ptr<Request> r) override {
    std::lock_guard<std::mutex> lock(mu_);
    pending_.push_back(std::move(r));
    fill_locked();
  }

  void shutdown() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_ || !reaper_.joinable()) return;
      stopping_ = true;
      io_uring_sqe* sqe = ring_.get_sqe();
      sqe->opcode = IORING_OP_NOP;
      sqe->user_data = kWakeTag;
      ring_.submit();
    }
    reaper_.join();
  }

 private:
  void prep(Piece* p) {
    io_uring_sqe* sqe = ring_.get_sqe();
    // Invariant: at most queue_depth pieces in flight and the ring is larger.
    if (sqe == nullptr) std::abort();
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

  // Under mu_: tops the ring up to the queue depth and submits.
  void fill_locked() {
    Piece p;
    while (inflight_ < queue_depth_ && take_piece(&pending_, block_bytes_, &p)) {
      prep(new Piece(p));
      ++inflight_;
    }
    submit_locked();
  }

  void submit_locked() {
    const int err = ring_.submit();
    // Entries are validated before they reach the ring, so a failing
    // io_uring_enter means the ring itself broke; nothing can complete.
    if (err < 0) std::abort();
  }

  // Under mu_: one completion. Returns a request to complete, or nullptr.
  Request* on_cqe(uint64_t user_data, int32_t res) {
    if (user_data == kWakeTag) return nullptr;
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
    for (;;) {
      if (ring_.wait_cqe() < 0) std::abort();  // only EFAULT/EBADF-type bugs land here
      bool exit = false;
      {
        std::lock_guard<std::mutex> lock(mu_);
        uint64_t user_data;
        int32_t res;
        while (ring_.pop_cqe(&user_data, &res)) {
          if (Request* r = on_cqe(user_data, res)) finished.push_back(r);
        }
        fill_locked();
        exit = stopping_ && inflight_ == 0 && pending_.empty();
      }
      for (Request* r : finished) engine_->complete(r);
      finished.clear();
      if (exit) return;
    }
  }

  Engine* engine_;
  const unsigned queue_depth_;
  const uint64_t block_bytes_;
  Ring ring_;
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

// Asynchronous file IO engine: per-request tickets over two lanes (reads and
// writes), each an io_uring ring or a pread/pwrite thread pool.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "io/files.h"

namespace luwu::io {

// O_DIRECT alignment for file offsets, lengths and memory addresses. 4 KiB
// covers every logical block size in practice (512 B and 4 KiB devices).
constexpr uint64_t kAlign = 4096;

enum class Backend { kIoUring, kThreads };
enum class Op { kRead, kWrite };

// One caller request: `nbytes` at file `offset` from/to `buf`.
struct Request {
  uint64_t id = 0;
  Op op = Op::kRead;
  std::shared_ptr<OpenFile> file;
  char* buf = nullptr;
  uint64_t offset = 0;
  uint64_t nbytes = 0;
  bool durable = false;
  // Scheduling state, guarded by the owning lane's mutex.
  uint64_t next = 0;     // bytes [0, next) handed out as pieces
  int inflight = 0;      // pieces submitted and not completed
  bool synced = false;   // fdatasync issued (durable writes)
  // Outcome: 0 or an errno with a message; set once, first error wins.
  int err = 0;
  std::string msg;
};

// A contiguous part of a request in flight. `pos` is relative to the request.
struct Piece {
  Request* req = nullptr;
  uint64_t pos = 0;
  uint64_t len = 0;
  bool sync = false;  // an fdatasync, not data
};

// What to do after a piece's syscall returned `res` (bytes or -errno).
enum class Step { kDone, kRetry };
// Advances `p` past `res` bytes; records an error in the request on failure.
Step account(Piece* p, int64_t res);
// Cuts the next piece of `r` (aligned head / block_bytes body / tail);
// false once all bytes are handed out or the request already failed.
bool cut_piece(Request* r, uint64_t block_bytes, Piece* p);
// The descriptor a piece must use: O_DIRECT when offset, address and length
// are all aligned, the page-cache one otherwise.
int piece_fd(const Piece& p);
// True when no more pieces will be issued for `r` and none is in flight.
inline bool data_finished(const Request& r) {
  return r.inflight == 0 && (r.err != 0 || r.next == r.nbytes);
}
// Under the lane lock: the next piece from the oldest pending request
// (requests then complete roughly in submission order), popping exhausted
// ones. Counts the piece in the request's `inflight`.
bool take_piece(std::deque<std::shared_ptr<Request>>* pending, uint64_t block_bytes, Piece* p);
// Under the lane lock, after a piece of `r` completed and was uncounted:
// kSync means issue Piece{r, 0, 0, true} (already counted), kComplete means
// hand `r` to Engine::complete once the lock is released.
enum class After { kNothing, kSync, kComplete };
After after_piece(Request* r);

class Engine;

// One direction's queue of requests and its way of executing pieces.
class Lane {
 public:
  virtual ~Lane() = default;
  virtual void enqueue(std::shared_ptr<Request> r) = 0;
  // Stops the lane after the pieces in flight complete.
  virtual void shutdown() = 0;
};

std::unique_ptr<Lane> make_uring_lane(Engine* engine, unsigned queue_depth, uint64_t block_bytes, int* err);
std::unique_ptr<Lane> make_thread_lane(Engine* engine, unsigned queue_depth, uint64_t block_bytes,
                                       unsigned num_threads);

struct WaitResult {
  int err = 0;
  std::string msg;
  // When the request completed (its last piece), on std::chrono::steady_clock in seconds: a waiter that comes
  // late still learns when the transfer itself ended ([Note: when a transfer ended] in engine.cpp).
  double done_s = 0.0;
};

class Engine {
 public:
  // Throws std::system_error when the io_uring rings cannot be set up.
  Engine(Backend backend, unsigned queue_depth, uint64_t block_bytes, unsigned num_threads,
         size_t num_cached_files);
  ~Engine();

  // Returns a ticket (> 0), or 0 with `open_err` set when the file cannot be
  // opened; `path` names the file, `fd` >= 0 (owned by the caller) overrides it.
  uint64_t submit(Op op, const std::string& path, int fd, uintptr_t buf, uint64_t offset, uint64_t nbytes,
                  bool durable, WaitResult* open_err);
  // Blocks until the ticket completes and forgets it. err == -1: unknown ticket.
  WaitResult wait(uint64_t ticket);
  bool done(uint64_t ticket);
  size_t num_pending();
  void forget(const std::string& path) { files_.forget(path); }
  void close();
  Backend backend() const { return backend_; }

  // Called by lanes, with no lane lock held, when a request has finished.
  // Requests stay alive through `tickets_` until waited for, so lanes may
  // hold plain pointers to them while pieces are in flight.
  void complete(Request* r);

 private:
  Backend backend_;
  FileCache files_;
  std::unique_ptr<Lane> lanes_[2];  // [Op::kRead], [Op::kWrite]
  // Guards tickets_ and closed_. Lock order: mu_ before a lane's mutex (submit
  // enqueues under mu_); lanes call complete() with their own mutex released.
  std::mutex mu_;
  std::condition_variable cv_;
  struct Slot {
    std::shared_ptr<Request> req;
    bool done = false;
    bool waited = false;
    double done_s = 0.0;
  };
  std::unordered_map<uint64_t, Slot> tickets_;
  uint64_t next_id_ = 1;
  bool closed_ = false;
};

}  // namespace luwu::io

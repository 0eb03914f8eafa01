#include "io/engine.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <system_error>

namespace luwu::io {
namespace {

bool aligned(uint64_t v) { return (v & (kAlign - 1)) == 0; }

void fail(Request* r, int err, const std::string& what) {
  if (r->err != 0) return;  // the first failure explains the request best
  r->err = err;
  r->msg = what;
}

std::string describe(const Piece& p) {
  const Request& r = *p.req;
  return std::string(r.op == Op::kRead ? "read" : "write") + " of " + std::to_string(p.len) +
         " bytes at offset " + std::to_string(r.offset + p.pos);
}

// [Note: extend before writing]
// ext4 (and XFS) run an O_DIRECT write that extends the file synchronously,
// so a deep queue of appending writes degenerates to one at a time. Growing
// the file first (fallocate: blocks reserved, so a full disk fails here, up
// front) turns every piece into an in-size write that proceeds in parallel.
int extend_for_write(int fd, uint64_t offset, uint64_t nbytes, std::string* msg) {
  struct stat st;
  if (fstat(fd, &st) != 0) return errno;
  const uint64_t end = offset + nbytes;
  if (!S_ISREG(st.st_mode) || end <= static_cast<uint64_t>(st.st_size)) return 0;
  const uint64_t start = offset > static_cast<uint64_t>(st.st_size) ? offset : st.st_size;
  int rc;
  do {
    rc = fallocate(fd, 0, static_cast<off_t>(start), static_cast<off_t>(end - start));
  } while (rc != 0 && errno == EINTR);
  if (rc != 0 && errno == EOPNOTSUPP) rc = ftruncate(fd, static_cast<off_t>(end));
  if (rc == 0) return 0;
  const int err = errno;
  *msg = std::string(std::strerror(err)) + " (cannot extend the file to " + std::to_string(end) + " bytes for a write of " +
         std::to_string(nbytes) + " bytes at offset " + std::to_string(offset) + ")";
  return err;
}

}  // namespace

Step account(Piece* p, int64_t res) {
  Request* r = p->req;
  if (res == -EINTR || res == -EAGAIN) return Step::kRetry;
  if (p->sync) {
    if (res < 0) fail(r, static_cast<int>(-res), std::string("fdatasync failed: ") + std::strerror(-res));
    return Step::kDone;
  }
  if (res < 0) {
    fail(r, static_cast<int>(-res), std::string(std::strerror(-res)) + " (" + describe(*p) + ")");
    return Step::kDone;
  }
  if (res == 0) {
    if (r->op == Op::kRead) {
      fail(r, ENODATA, "read past end of file (" + describe(*p) + " hit end of file; the request was " +
                           std::to_string(r->nbytes) + " bytes at offset " + std::to_string(r->offset) + ")");
    } else {
      fail(r, EIO, "write made no progress (" + describe(*p) + ")");
    }
    return Step::kDone;
  }
  // A short transfer is not an error: continue from where it stopped (the
  // remainder may have lost its alignment; piece_fd() then picks the
  // page-cache descriptor).
  p->pos += static_cast<uint64_t>(res);
  p->len -= static_cast<uint64_t>(res);
  return p->len == 0 ? Step::kDone : Step::kRetry;
}

bool cut_piece(Request* r, uint64_t block_bytes, Piece* p) {
  if (r->err != 0 || r->next >= r->nbytes) return false;
  const uint64_t off = r->offset + r->next;
  const uint64_t addr = reinterpret_cast<uintptr_t>(r->buf) + r->next;
  const uint64_t rem = r->nbytes - r->next;
  uint64_t len;
  // Direct IO is possible only when file offset and memory address share
  // their position within a 4 KiB page; otherwise no split can align both.
  if (r->file->direct_fd >= 0 && aligned(addr - off)) {
    const uint64_t head = (kAlign - (off & (kAlign - 1))) & (kAlign - 1);
    if (head != 0) {
      len = head < rem ? head : rem;
    } else if (rem >= kAlign) {
      const uint64_t body = rem & ~(kAlign - 1);
      len = body < block_bytes ? body : block_bytes;
    } else {
      len = rem;  // unaligned tail
    }
  } else {
    len = rem < block_bytes ? rem : block_bytes;
  }
  *p = Piece{r, r->next, len, false};
  r->next += len;
  return true;
}

bool take_piece(std::deque<std::shared_ptr<Request>>* pending, uint64_t block_bytes, Piece* p) {
  while (!pending->empty()) {
    Request* r = pending->front().get();
    if (cut_piece(r, block_bytes, p)) {
      ++r->inflight;
      return true;
    }
    pending->pop_front();
    // A durable write of zero bytes has no data piece to trigger its sync.
    if (r->nbytes == 0 && r->durable && !r->synced) {
      r->synced = true;
      ++r->inflight;
      *p = Piece{r, 0, 0, true};
      return true;
    }
  }
  return false;
}

After after_piece(Request* r) {
  if (!data_finished(*r)) return After::kNothing;
  if (r->durable && r->err == 0 && !r->synced) {
    r->synced = true;
    ++r->inflight;
    return After::kSync;
  }
  return After::kComplete;
}

int piece_fd(const Piece& p) {
  const Request& r = *p.req;
  const uint64_t addr = reinterpret_cast<uintptr_t>(r.buf) + p.pos;
  if (r.file->direct_fd >= 0 && aligned(r.offset + p.pos) && aligned(addr) && aligned(p.len)) {
    return r.file->direct_fd;
  }
  return r.file->buffered_fd;
}

Engine::Engine(Backend backend, unsigned queue_depth, uint64_t block_bytes, unsigned num_threads,
               size_t num_cached_files)
    : backend_(backend), files_(num_cached_files) {
  for (int i = 0; i < 2; ++i) {
    if (backend == Backend::kIoUring) {
      int err = 0;
      lanes_[i] = make_uring_lane(this, queue_depth, block_bytes, &err);
      if (err != 0) {
        lanes_[0].reset();
        throw std::system_error(err, std::generic_category(), "io_uring_setup");
      }
    } else {
      lanes_[i] = make_thread_lane(this, queue_depth, block_bytes, num_threads);
    }
  }
}

Engine::~Engine() { close(); }

void Engine::close() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return;
    closed_ = true;
  }
  // Lanes drain what is queued before stopping, so no piece outlives its buffer's owner.
  for (auto& lane : lanes_) {
    if (lane) lane->shutdown();
  }
  for (auto& lane : lanes_) lane.reset();
  files_.forget("");
}

uint64_t Engine::submit(Op op, const std::string& path, int fd, uintptr_t buf, uint64_t offset,
                        uint64_t nbytes, bool durable, WaitResult* open_err) {
  const bool for_write = op == Op::kWrite;
  OpenResult opened = fd >= 0 ? FileCache::wrap_fd(fd, for_write) : files_.open_path(path, for_write);
  if (opened.err != 0) {
    open_err->err = opened.err;
    open_err->msg = opened.msg;
    return 0;
  }
  if (for_write && nbytes > 0) {
    if (const int err = extend_for_write(opened.file->buffered_fd, offset, nbytes, &open_err->msg)) {
      open_err->err = err;
      return 0;
    }
  }
  auto r = std::make_shared<Request>();
  r->op = op;
  r->file = std::move(opened.file);
  r->buf = reinterpret_cast<char*>(buf);
  r->offset = offset;
  r->nbytes = nbytes;
  r->durable = durable && for_write;
  const bool immediate = nbytes == 0 && !r->durable;
  {
    // Enqueueing under mu_ orders it with close(): a request is either
    // refused or queued before the lanes drain and stop.
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) {
      open_err->err = EBADF;
      open_err->msg = "the IO engine is closed";
      return 0;
    }
    r->id = next_id_++;
    tickets_[r->id] = Slot{r, false, false};
    if (!immediate) lanes_[static_cast<int>(op)]->enqueue(r);
  }
  if (immediate) complete(r.get());
  return r->id;
}

// [Note: when a transfer ended]
// A transfer's completion is waited for by whoever needs its data, often long
// after the disk finished (the executor's IO stream completes a load in the
// event its consumer synchronises: [Note: IO in flight] in exec/streams.py).
// Timed at the wait, a trace showed the read queue busy 2.3 s for 8 KiB loads
// that the disk had finished in milliseconds. So the lane's reaper stamps each
// request as it completes, and the wait returns the stamp.
void Engine::complete(Request* r) {
  const double now = std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = tickets_.find(r->id);
    if (it != tickets_.end()) {
      it->second.done = true;
      it->second.done_s = now;
    }
  }
  // Waiters are few (usually one executor thread); waking all is simplest.
  cv_.notify_all();
}

WaitResult Engine::wait(uint64_t ticket) {
  std::unique_lock<std::mutex> lock(mu_);
  auto it = tickets_.find(ticket);
  if (it == tickets_.end()) return WaitResult{-1, "unknown or already waited-for ticket"};
  // A pointer, not the iterator: inserts by other threads may rehash.
  Slot* slot = &it->second;
  // Only one waiter per ticket: the first one erases the slot.
  if (slot->waited) return WaitResult{-1, "ticket is already being waited for"};
  slot->waited = true;
  cv_.wait(lock, [&] { return slot->done; });
  WaitResult out{slot->req->err, slot->req->msg, slot->done_s};
  tickets_.erase(ticket);
  return out;
}

bool Engine::done(uint64_t ticket) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = tickets_.find(ticket);
  return it == tickets_.end() || it->second.done;
}

size_t Engine::num_pending() {
  std::lock_guard<std::mutex> lock(mu_);
  return tickets_.size();
}

}  // namespace luwu::io

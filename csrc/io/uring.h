// Minimal io_uring ring over raw syscalls and <linux/io_uring.h>, so the
// build needs no liburing. One Ring is driven by one lane of the engine:
// submitters and the single completion reaper share it as described in
// [Note: ring ownership] in engine.cpp.
#pragma once

#include <linux/io_uring.h>

#include <cstddef>
#include <cstdint>

namespace luwu::io {

class Ring {
 public:
  Ring() = default;
  ~Ring();
  Ring(const Ring&) = delete;
  Ring& operator=(const Ring&) = delete;

  // Sets the ring up with at least `entries` submission slots, for use by a
  // single thread (SINGLE_ISSUER + DEFER_TASKRUN where the kernel has them,
  // 6.1+). Returns 0 or -errno (-ENOSYS / -EPERM where the kernel or a seccomp
  // filter forbids io_uring, -EOPNOTSUPP before 5.6, which lacks IORING_OP_READ).
  int init(unsigned entries);

  // Next free submission entry, zeroed; nullptr when the ring is full.
  io_uring_sqe* get_sqe();
  // Hands every prepared entry to the kernel and, unless a completion is
  // already queued, blocks until one arrives. Returns 0 or -errno.
  int submit_and_wait();
  // Pops one completion into (user_data, res); false when the queue is empty.
  bool pop_cqe(uint64_t* user_data, int32_t* res);

 private:
  int fd_ = -1;
  void* sq_ptr_ = nullptr;
  size_t sq_len_ = 0;
  void* cq_ptr_ = nullptr;
  size_t cq_len_ = 0;
  io_uring_sqe* sqes_ = nullptr;
  size_t sqes_len_ = 0;
  unsigned* sq_head_ = nullptr;
  unsigned* sq_tail_ = nullptr;
  unsigned* sq_array_ = nullptr;
  unsigned sq_mask_ = 0;
  unsigned sq_entries_ = 0;
  unsigned* cq_head_ = nullptr;
  unsigned* cq_tail_ = nullptr;
  unsigned cq_mask_ = 0;
  io_uring_cqe* cqes_ = nullptr;
  unsigned local_tail_ = 0;   // entries prepared but not yet published
  unsigned pending_ = 0;      // published entries the kernel has not consumed
};

}  // namespace luwu::io

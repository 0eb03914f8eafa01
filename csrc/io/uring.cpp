#include "io/uring.h"

#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace luwu::io {
namespace {

int sys_setup(unsigned entries, io_uring_params* p) {
  return static_cast<int>(syscall(__NR_io_uring_setup, entries, p));
}

int sys_enter(int fd, unsigned to_submit, unsigned min_complete, unsigned flags) {
  return static_cast<int>(syscall(__NR_io_uring_enter, fd, to_submit, min_complete, flags, nullptr, 0));
}

template <typename T>
T* at(void* base, unsigned off) {
  return reinterpret_cast<T*>(static_cast<char*>(base) + off);
}

}  // namespace

Ring::~Ring() {
  if (sqes_ != nullptr) munmap(sqes_, sqes_len_);
  if (cq_ptr_ != nullptr && cq_ptr_ != sq_ptr_) munmap(cq_ptr_, cq_len_);
  if (sq_ptr_ != nullptr) munmap(sq_ptr_, sq_len_);
  if (fd_ >= 0) close(fd_);
}

int Ring::init(unsigned entries) {
  io_uring_params p;
  std::memset(&p, 0, sizeof(p));
  // One thread submits and reaps, so completions can be run in that thread's
  // io_uring_enter instead of interrupting it with task work (DEFER_TASKRUN).
  p.flags = IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN;
  fd_ = sys_setup(entries, &p);
  if (fd_ < 0 && errno == EINVAL) {  // kernels before 6.1
    std::memset(&p, 0, sizeof(p));
    fd_ = sys_setup(entries, &p);
  }
  if (fd_ < 0) return -errno;
  // IORING_FEAT_RW_CUR_POS arrived in 5.6 together with IORING_OP_READ/WRITE,
  // the opcodes this engine relies on.
  if (!(p.features & IORING_FEAT_RW_CUR_POS)) return -EOPNOTSUPP;
  sq_len_ = p.sq_off.array + p.sq_entries * sizeof(unsigned);
  cq_len_ = p.cq_off.cqes + p.cq_entries * sizeof(io_uring_cqe);
  const bool single = (p.features & IORING_FEAT_SINGLE_MMAP) != 0;
  if (single) sq_len_ = cq_len_ = (sq_len_ > cq_len_ ? sq_len_ : cq_len_);
  sq_ptr_ = mmap(nullptr, sq_len_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd_, IORING_OFF_SQ_RING);
  if (sq_ptr_ == MAP_FAILED) { sq_ptr_ = nullptr; return -errno; }
  if (single) {
    cq_ptr_ = sq_ptr_;
  } else {
    cq_ptr_ = mmap(nullptr, cq_len_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd_, IORING_OFF_CQ_RING);
    if (cq_ptr_ == MAP_FAILED) { cq_ptr_ = nullptr; return -errno; }
  }
  sqes_len_ = p.sq_entries * sizeof(io_uring_sqe);
  void* s = mmap(nullptr, sqes_len_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd_, IORING_OFF_SQES);
  if (s == MAP_FAILED) return -errno;
  sqes_ = static_cast<io_uring_sqe*>(s);
  sq_head_ = at<unsigned>(sq_ptr_, p.sq_off.head);
  sq_tail_ = at<unsigned>(sq_ptr_, p.sq_off.tail);
  sq_array_ = at<unsigned>(sq_ptr_, p.sq_off.array);
  sq_mask_ = *at<unsigned>(sq_ptr_, p.sq_off.ring_mask);
  sq_entries_ = p.sq_entries;
  cq_head_ = at<unsigned>(cq_ptr_, p.cq_off.head);
  cq_tail_ = at<unsigned>(cq_ptr_, p.cq_off.tail);
  cq_mask_ = *at<unsigned>(cq_ptr_, p.cq_off.ring_mask);
  cqes_ = at<io_uring_cqe>(cq_ptr_, p.cq_off.cqes);
  local_tail_ = *sq_tail_;
  return 0;
}

io_uring_sqe* Ring::get_sqe() {
  const unsigned head = __atomic_load_n(sq_head_, __ATOMIC_ACQUIRE);
  if (local_tail_ - head >= sq_entries_) return nullptr;
  const unsigned idx = local_tail_ & sq_mask_;
  io_uring_sqe* sqe = &sqes_[idx];
  std::memset(sqe, 0, sizeof(*sqe));
  sq_array_[idx] = idx;
  ++local_tail_;
  return sqe;
}

int Ring::submit_and_wait() {
  const unsigned published = *sq_tail_;
  pending_ += local_tail_ - published;
  // Release: the kernel must see the entries before it sees the new tail.
  __atomic_store_n(sq_tail_, local_tail_, __ATOMIC_RELEASE);
  for (;;) {
    const bool have_cqe = __atomic_load_n(cq_tail_, __ATOMIC_ACQUIRE) != *cq_head_;
    if (pending_ == 0 && have_cqe) return 0;
    const int r = sys_enter(fd_, pending_, have_cqe ? 0 : 1, IORING_ENTER_GETEVENTS);
    if (r < 0) {
      // EINTR: a signal; EAGAIN/EBUSY: the kernel is short of resources or
      // completions are backed up. Entries stay queued; reap, then retry.
      if (errno == EINTR || errno == EAGAIN || errno == EBUSY) {
        if (__atomic_load_n(cq_tail_, __ATOMIC_ACQUIRE) != *cq_head_) return 0;
        continue;
      }
      return -errno;
    }
    pending_ -= static_cast<unsigned>(r);
    if (pending_ == 0 || __atomic_load_n(cq_tail_, __ATOMIC_ACQUIRE) != *cq_head_) return 0;
  }
}

bool Ring::pop_cqe(uint64_t* user_data, int32_t* res) {
  const unsigned head = *cq_head_;
  if (__atomic_load_n(cq_tail_, __ATOMIC_ACQUIRE) == head) return false;
  const io_uring_cqe& cqe = cqes_[head & cq_mask_];
  *user_data = cqe.user_data;
  *res = cqe.res;
  __atomic_store_n(cq_head_, head + 1, __ATOMIC_RELEASE);
  return true;
}

}  // namespace luwu::io

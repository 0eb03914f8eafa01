#include "io/aligned_buffer.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstdint>
#include <system_error>

namespace luwu::io {

namespace {

constexpr size_t kHugePage = size_t{2} << 20;

}  // namespace

// [Note: huge pages for IO buffers]
// A 1 MiB O_DIRECT piece over 4 KiB pages is 256 scatter-gather segments,
// more than many devices take in one command (virtio-blk: 254), so each piece
// is split in two and every page is pinned separately. Buffers of 2 MiB and
// more are therefore placed on a 2 MiB boundary and advised as huge pages
// (honoured when transparent huge pages are "always" or "madvise").
AlignedBuffer::AlignedBuffer(size_t nbytes, bool lock, bool huge_pages) : nbytes_(nbytes) {
  // Map at least one page so data() is a valid aligned address even for 0 bytes.
  mapped_ = nbytes == 0 ? 4096 : (nbytes + 4095) / 4096 * 4096;
  const bool huge = huge_pages && nbytes >= kHugePage;
  const size_t span = huge ? mapped_ + kHugePage : mapped_;
  void* p = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::system_error(errno, std::generic_category(), "mmap");
  char* base = static_cast<char*>(p);
  if (huge) {
    char* start = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(base) + kHugePage - 1) & ~(kHugePage - 1));
    if (start > base) munmap(base, static_cast<size_t>(start - base));
    const size_t tail = static_cast<size_t>(base + span - (start + mapped_));
    if (tail > 0) munmap(start + mapped_, tail);
    base = start;
    madvise(base, mapped_, MADV_HUGEPAGE);  // advice only: failure leaves 4 KiB pages
  }
  data_ = base;
  if (lock && nbytes > 0) locked_ = mlock(data_, mapped_) == 0;
}

AlignedBuffer::~AlignedBuffer() {
  if (hook_) {
    // A destructor cannot raise; a failing unregister only leaks the pin.
    try {
      hook_();
    } catch (...) {
    }
  }
  if (locked_) munlock(data_, mapped_);
  munmap(data_, mapped_);
}

}  // namespace luwu::io

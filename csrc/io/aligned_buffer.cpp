#include "io/aligned_buffer.h"

#include <sys/mman.h>

#include <cerrno>
#include <system_error>

namespace luwu::io {

AlignedBuffer::AlignedBuffer(size_t nbytes, bool lock) : nbytes_(nbytes) {
  // Map at least one page so data() is a valid aligned address even for 0 bytes.
  mapped_ = nbytes == 0 ? 4096 : nbytes;
  void* p = mmap(nullptr, mapped_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::system_error(errno, std::generic_category(), "mmap");
  data_ = p;
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

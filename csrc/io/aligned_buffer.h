// Page-aligned host memory for O_DIRECT IO, exported to Python through the
// buffer protocol so torch.frombuffer can wrap it without a copy.
#pragma once

#include <cstddef>
#include <functional>

namespace luwu::io {

class AlignedBuffer {
 public:
  // Anonymous mmap (page-aligned, zero-filled). `lock` tries mlock and
  // records whether it succeeded: RLIMIT_MEMLOCK may forbid it, which is not
  // an error, only slower under memory pressure. `huge_pages` places buffers
  // of 2 MiB and more on huge pages where the kernel allows.
  AlignedBuffer(size_t nbytes, bool lock, bool huge_pages);
  ~AlignedBuffer();
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;

  void* data() const { return data_; }
  size_t nbytes() const { return nbytes_; }
  bool locked() const { return locked_; }
  // Runs before the memory is unmapped (e.g. cudaHostUnregister).
  void set_release_hook(std::function<void()> hook) { hook_ = std::move(hook); }

 private:
  void* data_ = nullptr;
  size_t nbytes_ = 0;
  size_t mapped_ = 0;
  bool locked_ = false;
  std::function<void()> hook_;
};

}  // namespace luwu::io

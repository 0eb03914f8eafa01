// Open files for the IO engine: an O_DIRECT descriptor for aligned pieces and
// a buffered one for unaligned heads and tails, cached per path.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

namespace luwu::io {

// Descriptors of one file. Requests hold a shared_ptr, so a file evicted from
// the cache stays open until its last request completes.
struct OpenFile {
  int direct_fd = -1;    // O_DIRECT; -1 where the file system refuses it (tmpfs)
  int buffered_fd = -1;  // page-cache descriptor for unaligned pieces
  bool owns_direct = false;
  bool owns_buffered = false;
  dev_t dev = 0;
  ino_t ino = 0;
  ~OpenFile();
};

// Result of opening: a file or an errno with the reason.
struct OpenResult {
  std::shared_ptr<OpenFile> file;
  int err = 0;
  std::string msg;
};

class FileCache {
 public:
  explicit FileCache(size_t num_entries) : capacity_(num_entries) {}
  // Opens `path` for reading or writing (created, never truncated), reusing a
  // cached descriptor when the path still names the same inode.
  OpenResult open_path(const std::string& path, bool for_write);
  // Wraps a descriptor owned by the caller (see [Note: caller fds] in files.cpp).
  static OpenResult wrap_fd(int fd, bool for_write);
  // Drops cached descriptors of `path` ("" drops all).
  void forget(const std::string& path);

 private:
  struct Entry {
    std::shared_ptr<OpenFile> file;
    std::list<std::string>::iterator lru;
  };
  std::mutex mu_;
  size_t capacity_;
  std::unordered_map<std::string, Entry> map_;  // key: mode char + path
  std::list<std::string> lru_;                  // most recent at front
};

}  // namespace luwu::io

#include "io/files.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace luwu::io {
namespace {

int open_retry(const char* path, int flags, mode_t mode) {
  int fd;
  do {
    fd = ::open(path, flags | O_CLOEXEC, mode);
  } while (fd < 0 && errno == EINTR);
  return fd;
}

OpenResult fail(int err, const std::string& what) {
  OpenResult r;
  r.err = err;
  r.msg = what + ": " + std::strerror(err);
  return r;
}

// Regular files and block devices are accepted; a directory is EISDIR even
// when open(2) let it through (O_RDONLY on a directory succeeds).
int check_kind(int fd, struct stat* st) {
  if (fstat(fd, st) != 0) return errno;
  if (S_ISDIR(st->st_mode)) return EISDIR;
  if (!S_ISREG(st->st_mode) && !S_ISBLK(st->st_mode)) return EINVAL;
  return 0;
}

}  // namespace

OpenFile::~OpenFile() {
  if (owns_direct && direct_fd >= 0) ::close(direct_fd);
  if (owns_buffered && buffered_fd >= 0) ::close(buffered_fd);
}

OpenResult FileCache::open_path(const std::string& path, bool for_write) {
  const std::string key = (for_write ? "w" : "r") + path;
  struct stat st;
  const bool exists = ::stat(path.c_str(), &st) == 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = map_.find(key);
    if (it != map_.end()) {
      // A rename or unlink+create since we opened it (an atomic checkpoint
      // replace, a test reusing a name) must not read the old inode.
      if (exists && it->second.file->dev == st.st_dev && it->second.file->ino == st.st_ino) {
        lru_.splice(lru_.begin(), lru_, it->second.lru);
        return OpenResult{it->second.file, 0, {}};
      }
      lru_.erase(it->second.lru);
      map_.erase(it);
    }
  }
  auto file = std::make_shared<OpenFile>();
  const int access = for_write ? (O_RDWR | O_CREAT) : O_RDONLY;
  file->buffered_fd = open_retry(path.c_str(), access, 0644);
  if (file->buffered_fd < 0) return fail(errno, for_write ? "cannot open for writing" : "cannot open for reading");
  file->owns_buffered = true;
  if (const int err = check_kind(file->buffered_fd, &st)) return fail(err, "not a regular file");
  file->dev = st.st_dev;
  file->ino = st.st_ino;
  file->direct_fd = open_retry(path.c_str(), (access & ~O_CREAT) | O_DIRECT, 0);
  // EINVAL: the file system has no O_DIRECT (tmpfs); every piece then goes
  // through the page cache, which is still correct.
  if (file->direct_fd < 0 && errno != EINVAL) return fail(errno, "cannot open with O_DIRECT");
  file->owns_direct = file->direct_fd >= 0;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = map_.find(key);
  if (it != map_.end()) {  // another thread opened it meanwhile; keep ours for this request
    return OpenResult{file, 0, {}};
  }
  lru_.push_front(key);
  map_[key] = Entry{file, lru_.begin()};
  while (map_.size() > capacity_) {
    map_.erase(lru_.back());
    lru_.pop_back();
  }
  return OpenResult{file, 0, {}};
}

// [Note: caller fds]
// A descriptor passed in by the caller is used as it is and never closed.
// If it was opened with O_DIRECT, aligned pieces use it directly and the
// unaligned head/tail need a page-cache twin: /proc/self/fd/N reopened
// without O_DIRECT, owned by the request. Without O_DIRECT every piece uses
// the caller's descriptor through the page cache.
OpenResult FileCache::wrap_fd(int fd, bool for_write) {
  const int flags = fcntl(fd, F_GETFL);
  if (flags < 0) return fail(errno, "bad file descriptor " + std::to_string(fd));
  const int mode = flags & O_ACCMODE;
  if (for_write ? mode == O_RDONLY : mode == O_WRONLY) {
    return fail(EBADF, std::string("descriptor is not open for ") + (for_write ? "writing" : "reading"));
  }
  auto file = std::make_shared<OpenFile>();
  struct stat st;
  if (const int err = check_kind(fd, &st)) return fail(err, "not a regular file");
  file->dev = st.st_dev;
  file->ino = st.st_ino;
  if (!(flags & O_DIRECT)) {
    file->buffered_fd = fd;
    return OpenResult{file, 0, {}};
  }
  file->direct_fd = fd;
  const std::string proc = "/proc/self/fd/" + std::to_string(fd);
  file->buffered_fd = open_retry(proc.c_str(), mode, 0);
  if (file->buffered_fd < 0) return fail(errno, "cannot reopen " + proc + " without O_DIRECT");
  file->owns_buffered = true;
  return OpenResult{file, 0, {}};
}

void FileCache::forget(const std::string& path) {
  std::lock_guard<std::mutex> lock(mu_);
  if (path.empty()) {
    map_.clear();
    lru_.clear();
    return;
  }
  for (const char* mode : {"r", "w"}) {
    auto it = map_.find(mode + path);
    if (it == map_.end()) continue;
    lru_.erase(it->second.lru);
    map_.erase(it);
  }
}

}  // namespace luwu::io

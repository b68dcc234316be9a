#include "net/shm_window.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace ringmaster::net {
namespace {

std::string sys_error(const std::string& what) { return what + ": " + std::strerror(errno); }

constexpr int kSeals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;

}  // namespace

std::shared_ptr<shm_window> shm_window::create(size_t bytes, std::string* error) {
  if (bytes == 0 || bytes > kShmMaxWindow) return *error = "a window of " + std::to_string(bytes) + " bytes", nullptr;
  std::shared_ptr<shm_window> w(new shm_window());
  w->fd_ = memfd_create("ringmaster-window", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (w->fd_ < 0) return *error = sys_error("memfd_create"), nullptr;
  // posix_fallocate, not ftruncate alone: no room must fail here, not as SIGBUS on a later write.
  if (fchmod(w->fd_, 0600) != 0) return *error = sys_error("chmod the window"), nullptr;
  if (int e = posix_fallocate(w->fd_, 0, off_t(bytes)); e != 0) {
    errno = e;
    return *error = sys_error("reserve " + std::to_string(bytes >> 20) + " MiB of shared memory"), nullptr;
  }
  if (fcntl(w->fd_, F_ADD_SEALS, kSeals) != 0) return *error = sys_error("seal the window"), nullptr;
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, w->fd_, 0);
  if (p == MAP_FAILED) return *error = sys_error("mmap the window"), nullptr;
  w->base_ = p;
  w->bytes_ = bytes;
  struct stat st {};
  if (fstat(w->fd_, &st) != 0) return *error = sys_error("stat the window"), nullptr;
  w->id_ = {int32_t(getpid()), w->fd_, uint64_t(st.st_dev), uint64_t(st.st_ino), uint64_t(bytes)};
  return w;
}

shm_window::~shm_window() {
  if (base_) munmap(base_, bytes_);
  if (fd_ >= 0) close(fd_);
}

bool shm_window::holds(const void* p, size_t n, uint64_t* offset) const {
  const auto a = reinterpret_cast<uintptr_t>(p), b = reinterpret_cast<uintptr_t>(base_);
  if (a < b || a - b > bytes_ || n > bytes_ - (a - b)) return false;
  *offset = a - b;
  return true;
}

std::shared_ptr<const shm_window_view> shm_window_view::open(const shm_window_id& id, std::string* error) {
  if (id.pid <= 0 || id.fd < 0 || id.bytes == 0 || id.bytes > kShmMaxWindow) {
    *error = "a window described as pid " + std::to_string(id.pid) + ", fd " + std::to_string(id.fd) + ", " +
             std::to_string(id.bytes) + " bytes";
    return nullptr;
  }
  const std::string path = "/proc/" + std::to_string(id.pid) + "/fd/" + std::to_string(id.fd);
  // O_PATH first: whatever that fd is now (a terminal, a FIFO, a device), looking at it opens nothing.
  const int at = ::open(path.c_str(), O_PATH | O_CLOEXEC);
  if (at < 0) return *error = sys_error("open " + path), nullptr;
  struct stat st {};
  // Its own pages, every one (the lender reserved them): mapping it allocates nothing here.
  const bool same = fstat(at, &st) == 0 && S_ISREG(st.st_mode) && uint64_t(st.st_dev) == id.dev &&
                    uint64_t(st.st_ino) == id.ino && st.st_uid == geteuid() && uint64_t(st.st_size) == id.bytes &&
                    uint64_t(st.st_blocks) * 512 >= id.bytes;
  const int fd = same ? ::open(("/proc/self/fd/" + std::to_string(at)).c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK) : -1;
  close(at);
  // Sealed against shrinking: no one can cut the file short under our mapping.
  const int seals = fd >= 0 ? fcntl(fd, F_GET_SEALS) : -1;
  if (!same || seals < 0 || (seals & (F_SEAL_SHRINK | F_SEAL_GROW)) != (F_SEAL_SHRINK | F_SEAL_GROW)) {
    if (fd >= 0) close(fd);
    *error = path + " is not the window described (identity, owner, size, pages or seals)";
    return nullptr;
  }
  // Not populated: the seals do not stop the lender from punching holes after the check above, and a
  // populating read of a hole would allocate it here. Pages fault in as chunks are read, once each.
  void* p = mmap(nullptr, id.bytes, PROT_READ, MAP_SHARED, fd, 0);
  close(fd);  // the mapping holds the file
  if (p == MAP_FAILED) return *error = sys_error("mmap " + path), nullptr;
  std::shared_ptr<shm_window_view> v(new shm_window_view());
  v->base_ = p;
  v->bytes_ = id.bytes;
  return v;
}

shm_window_view::~shm_window_view() {
  if (base_) munmap(base_, bytes_);
}

}  // namespace ringmaster::net

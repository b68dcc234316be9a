// Memory one process lends, read-only, to a neighbour process of its user on its host: a replica's
// gradients, which the rank to its right then reads in place, as a neighbour in the same process does,
// instead of receiving a copy in the shared-memory link's buffer (net/shm_link.hpp). That copy was one
// pass over the whole gradient a step, the largest part of what 2 nodes on one host spent beyond 2
// replicas in one process.
//
// A window is an anonymous file (memfd) of our user, mode 0600, sealed against shrinking and growing:
// a neighbour's mapping can never fault (SIGBUS) on a file cut short under it, and a window leaves no
// name behind when its process is killed. The neighbour opens it as /proc/<pid>/fd/<fd>, which the
// kernel allows only to a process that could ptrace ours (our user, or root); it checks the file's
// identity (device and inode), owner, size and seals before it maps it, read-only. Where that is not
// allowed (another pid namespace, a hardened kernel) the link goes on copying.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace ringmaster::net {

// What a neighbour needs to find a window and to know it is the one meant.
struct shm_window_id {
  int32_t pid = 0;
  int32_t fd = -1;
  uint64_t dev = 0, ino = 0;
  uint64_t bytes = 0;
};

// The lender's side: writable, lives as long as its last holder (the replica whose gradients it holds,
// and the link that lends it).
class shm_window {
 public:
  // nullptr with *error when there is no such memory to be had (no memfd, no room).
  static std::shared_ptr<shm_window> create(size_t bytes, std::string* error);
  ~shm_window();
  shm_window(const shm_window&) = delete;
  shm_window& operator=(const shm_window&) = delete;

  float* floats() const { return static_cast<float*>(base_); }
  size_t bytes() const { return bytes_; }
  shm_window_id id() const { return id_; }
  // Whether [p, p + n) lies inside; its offset in *offset.
  bool holds(const void* p, size_t n, uint64_t* offset) const;

 private:
  shm_window() = default;
  void* base_ = nullptr;
  size_t bytes_ = 0;
  int fd_ = -1;
  shm_window_id id_;
};

// The neighbour's side: the same memory, read-only.
class shm_window_view {
 public:
  // nullptr with *error when it cannot be opened or is not the window `id` describes.
  static std::shared_ptr<const shm_window_view> open(const shm_window_id& id, std::string* error);
  ~shm_window_view();
  shm_window_view(const shm_window_view&) = delete;
  shm_window_view& operator=(const shm_window_view&) = delete;

  const unsigned char* data() const { return static_cast<const unsigned char*>(base_); }
  size_t bytes() const { return bytes_; }

 private:
  shm_window_view() = default;
  void* base_ = nullptr;
  size_t bytes_ = 0;
};

// The largest window a neighbour maps (a lying one must not make us reserve address space without end).
constexpr uint64_t kShmMaxWindow = uint64_t(64) << 30;

}  // namespace ringmaster::net

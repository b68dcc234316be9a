#include "net/shm_link.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <fstream>

#include <openssl/evp.h>

#include "net/shm_segment.hpp"

// The link's two sides: net/shm_receiver.cpp and net/shm_sender.cpp; the segment's layout: net/shm_segment.hpp.
namespace ringmaster::net {
using namespace shm_segment;

std::string shm_name(const shm_stamp& s) {
  // Anyone may list /dev/shm: the name holds a hash of the ring and the rank, not the job's id.
  static const char kDomain[] = "ringmaster shm segment";
  unsigned char msg[sizeof kDomain - 1 + 12];
  std::memcpy(msg, kDomain, sizeof kDomain - 1);
  unsigned char* p = msg + sizeof kDomain - 1;
  for (int i = 0; i < 8; ++i) *p++ = static_cast<unsigned char>(s.job >> (8 * i));
  for (int i = 0; i < 4; ++i) *p++ = static_cast<unsigned char>(uint32_t(s.receiver_rank) >> (8 * i));
  unsigned char md[EVP_MAX_MD_SIZE] = {};
  unsigned int md_len = 0;
  EVP_Digest(msg, sizeof msg, md, &md_len, EVP_sha256(), nullptr);  // cannot fail short of no memory
  char name[96];
  int n = std::snprintf(name, sizeof name, "/ringmaster.%u.", unsigned(geteuid()));
  for (int i = 0; i < 12; ++i) n += std::snprintf(name + n, sizeof name - size_t(n), "%02x", md[i]);
  return name;
}

bool poll_reaping(shm_receiver* in, shm_sender& out, std::chrono::steady_clock::time_point until,
                  const std::function<bool()>& done) {
  shm_sender::reaper r(out);
  const auto reaped = [&] {
    out.reap();
    return done();
  };
  return in ? in->poll(until, reaped) : reaped();
}

// ---- hosts and leftovers ----

std::string host_id() {
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string boot;
  struct stat shm {};
  if (!std::getline(in, boot) || boot.size() < 32 || boot.size() > 40 || stat("/dev/shm", &shm) != 0) return "";
  // Containers share the boot id; their /dev/shm mounts tell them apart.
  char dev[48];
  std::snprintf(dev, sizeof dev, "%llx.%llx", (unsigned long long)shm.st_dev, (unsigned long long)shm.st_ino);
  return boot + "/" + dev + "/" + std::to_string(geteuid());
}

int sweep_segments() {
  const std::string prefix = "ringmaster." + std::to_string(geteuid()) + ".";
  DIR* dir = opendir("/dev/shm");
  if (!dir) return 0;
  int removed = 0;
  while (dirent* e = readdir(dir)) {
    const std::string name = e->d_name;
    if (name.compare(0, prefix.size(), prefix) != 0) continue;
    // Non-blocking (a FIFO of this name must not hang us), ours and a plain file, before anything is read.
    fd_guard f;
    f.fd = shm_open(("/" + name).c_str(), O_RDONLY | O_NONBLOCK, 0);
    struct stat st {};
    if (f.fd < 0 || fstat(f.fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != geteuid() ||
        st.st_size < off_t(sizeof(control)))
      continue;
    unsigned char raw[sizeof(control)];  // only the stamp: read, not mapped
    uint64_t magic = 0;
    if (pread(f.fd, raw, sizeof raw, 0) != ssize_t(sizeof raw)) continue;
    std::memcpy(&magic, raw + offsetof(control, magic), sizeof magic);
    // Its receiver holds a lock on it while it lives (whatever pid namespace it is in): none, it is gone.
    if (magic == kShmMagic && flock(f.fd, LOCK_EX | LOCK_NB) == 0) removed += shm_unlink(("/" + name).c_str()) == 0;
  }
  closedir(dir);
  return removed;
}

}  // namespace ringmaster::net

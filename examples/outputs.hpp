// A launcher's output files (weights, a report), checked before training rather than found unwritable
// after hours of it.
#pragma once
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kernels/safetensors.hpp"

namespace ringmaster::examples {

// "" when `path` (if given) can be written when the run ends. What is there and not a plain file (a link
// to a file, a FIFO, a device, /dev/stdout) is written through: only it must take writes, and a FIFO must
// have its reader now (with none the run's result would be lost after training; it is held open in *hold
// until then, so that its reader does not see its end before). A plain file, or a new one, is written
// under a temporary name in its folder and renamed: the folder must take new files, which a probe file
// made and removed at once shows (access() alone passes /proc and /sys for root). A link to nothing yet
// is written through too: the file it names is made and removed. Nothing else is created or changed.
// A link or FIFO of another user's is refused (foreign_output).
inline std::string check_writable(const std::string& path, std::shared_ptr<const void>* hold) {
  if (path.empty()) return "";
  if (std::string why = foreign_output(path); !why.empty()) return "cannot write " + path + ": " + why;
  struct stat st {};
  if (lstat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode) && stat(path.c_str(), &st) == 0) {
    if (S_ISDIR(st.st_mode)) return "cannot write " + path + ": it is a folder";
    if (own_stream(path) >= 0) return "";  // our own stdout or stderr is written as it is, not opened
    if (access(path.c_str(), W_OK) != 0) return "cannot write " + path + ": it is not writable";
    if (S_ISFIFO(st.st_mode)) {
      const int fd = ::open(path.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC), why = errno;
      if (fd < 0)
        return "cannot write " + path + ": " + (why == ENXIO ? "a FIFO nothing reads from (start its reader first)" : std::strerror(why));
      *hold = std::shared_ptr<const void>(nullptr, [fd](const void*) { ::close(fd); });
    }
    return "";
  }
  if (lstat(path.c_str(), &st) == 0 && S_ISLNK(st.st_mode)) {
    // A link to nothing yet: written through at the end, as a shell's `>` does, making the file it names.
    // That file is made now and removed: the links followed by hand to the last one's target, made only
    // where nothing is (O_EXCL: nothing of anyone else's is ever removed), removed only while still ours.
    std::string target = path;
    for (int hops = 0;; ++hops) {
      struct stat l {};
      if (lstat(target.c_str(), &l) != 0) break;  // nothing there (or unreachable): the open below says
      if (!S_ISLNK(l.st_mode)) return "";          // made meanwhile: written through, as any file
      if (hops == 40) return "cannot write " + path + ": its links go round in a loop";
      char to[4096];
      const ssize_t n = readlink(target.c_str(), to, sizeof to - 1);
      if (n <= 0) return "cannot write " + path + ": cannot read the link " + target;
      to[n] = '\0';
      const size_t cut = target.rfind('/');
      target = to[0] == '/' || cut == std::string::npos ? std::string(to) : target.substr(0, cut + 1) + to;
    }
    const int fd = ::open(target.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0644);
    const int why = errno;  // before a message allocates
    if (fd < 0 && why == EEXIST) return "";  // made meanwhile
    if (fd < 0) return "cannot write " + path + ": it links to " + target + ", which cannot be made (" + std::strerror(why) + ")";
    struct stat made {}, now {};
    if (fstat(fd, &made) == 0 && lstat(target.c_str(), &now) == 0 && now.st_dev == made.st_dev && now.st_ino == made.st_ino)
      ::unlink(target.c_str());
    ::close(fd);
    return "";
  }
  const size_t slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
  if (stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) return "cannot write " + path + ": no folder " + dir;
  if (access(dir.c_str(), W_OK | X_OK) != 0) return "cannot write " + path + ": folder " + dir + " is not writable";
  // (The file is written under a temporary name that fits whenever its own name does.)
  const long name_max = pathconf(dir.c_str(), _PC_NAME_MAX);
  if (name_max > 0 && path.size() - (slash == std::string::npos ? 0 : slash + 1) > size_t(name_max))
    return "cannot write " + path + ": its name is longer than the " + std::to_string(name_max) + " bytes that folder " + dir + " allows";
  if (stat(path.c_str(), &st) == 0 && access(path.c_str(), W_OK) != 0) return "cannot write " + path + ": the file is not writable";
  // A file of another user's in a sticky folder (/tmp) cannot be replaced, though it may be writable.
  struct stat folder {};
  if (stat(path.c_str(), &st) == 0 && stat(dir.c_str(), &folder) == 0 && (folder.st_mode & S_ISVTX) && geteuid() != 0 &&
      st.st_uid != geteuid() && folder.st_uid != geteuid())
    return "cannot write " + path + ": it belongs to another user, in a folder (as /tmp) where only its owner may replace it";
  // A name of this run's own (two launchers may share a folder, over NFS too; a killed one may leave its probe).
  std::random_device rd;
  for (int tries = 0;; ++tries) {
    char name[48];
    std::snprintf(name, sizeof name, "/.ringmaster-probe-%d-%08x", int(::getpid()), unsigned(rd()));
    const std::string probe = dir + name;
    const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd >= 0) {
      ::close(fd);
      ::unlink(probe.c_str());
      return "";
    }
    if (errno != EEXIST || tries == 3)
      return "cannot write " + path + ": folder " + dir + " takes no new files (making one there failed: " + std::strerror(errno) + ")";
  }
}

// An output file and how many bytes it will take (its --flag, for messages).
struct output_size {
  std::string flag, path;
  double bytes = 0;
};

// "" when the file systems the outputs go to (each checked by check_writable) have room for them, those on
// one file system together. A plain or new file is written whole under a temporary name in its folder
// before the old one goes (write_whole), so an old file's size does not count; a link to a file is written
// through, in its place, so that file's size does. Not checked: what is not a file (a device, a FIFO), a
// file system that says nothing of its blocks (some FUSE and network ones: the write will say), quotas.
inline std::string check_room(const std::vector<output_size>& outputs) {
  struct room {
    std::string where, flags;
    double free = 0, needed = 0;
  };
  std::map<dev_t, room> by_fs;
  for (const output_size& o : outputs) {
    if (o.path.empty()) continue;
    struct stat l {}, st {};
    const bool there = ::lstat(o.path.c_str(), &l) == 0, through = there && S_ISLNK(l.st_mode) && ::stat(o.path.c_str(), &st) == 0;
    if (there && !S_ISREG(l.st_mode) && !(through && S_ISREG(st.st_mode))) continue;  // a device, a FIFO, a link to nothing yet
    const size_t slash = o.path.rfind('/');
    const std::string where = through ? o.path : slash == std::string::npos ? "." : slash == 0 ? "/" : o.path.substr(0, slash);
    struct stat w {};
    struct statvfs fs {};
    if (::stat(where.c_str(), &w) != 0 || ::statvfs(where.c_str(), &fs) != 0 || fs.f_blocks == 0) continue;
    room& r = by_fs[w.st_dev];
    if (r.where.empty()) r.where = through ? "the file system of " + o.path : "folder " + where;
    r.flags += (r.flags.empty() ? "" : " and ") + o.flag + " " + o.path;
    r.free = double(fs.f_bavail) * double(fs.f_frsize);
    r.needed += std::max(0.0, o.bytes - (through ? double(st.st_size) : 0.0));
  }
  for (const auto& [dev, r] : by_fs) {
    (void)dev;
    if (r.free >= r.needed) continue;
    char figures[160];
    std::snprintf(figures, sizeof figures, " has %.1f MB free, and this job's outputs need %.1f MB there", r.free / 1e6, r.needed / 1e6);
    return r.flags + ": " + r.where + figures;
  }
  return "";
}

// "" unless `path` (given, and there) is the file one of `inputs` (a path, and what it is) names, links
// followed: then what and which, for the error (a --save over a data file replaced it with weights).
inline std::string input_named(const std::string& path, const std::vector<std::pair<std::string, std::string>>& inputs) {
  struct stat out {};
  if (path.empty() || ::stat(path.c_str(), &out) != 0 || !S_ISREG(out.st_mode)) return "";
  for (const auto& [in, what] : inputs) {
    struct stat st {};
    if (::stat(in.c_str(), &st) == 0 && st.st_dev == out.st_dev && st.st_ino == out.st_ino) return what + " " + in;
  }
  return "";
}

}  // namespace ringmaster::examples

// A launcher's output files (weights, a report), checked before training rather than found unwritable
// after hours of it.
#pragma once
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <string>

namespace ringmaster::examples {

// "" when `path` (if given) can be written when the run ends: its folder exists and takes files, and the
// file, if it is there, is a file we may overwrite, or a FIFO something reads from now (written through
// at the end: with no reader the run's result would be lost after training). Such a FIFO is held open in
// *hold until then, so that its reader does not see its end before. A file is written under a temporary
// name in its folder and renamed: a probe file is made there and removed at once (access() alone passes
// folders that take no files, such as /proc and /sys for root); nothing else is created or changed.
inline std::string check_writable(const std::string& path, std::shared_ptr<const void>* hold) {
  if (path.empty()) return "";
  const size_t slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
  struct stat st {};
  if (stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) return "cannot write " + path + ": no folder " + dir;
  if (access(dir.c_str(), W_OK | X_OK) != 0) return "cannot write " + path + ": folder " + dir + " is not writable";
  // (The file is written under a temporary name that fits whenever its own name does.)
  const long name_max = pathconf(dir.c_str(), _PC_NAME_MAX);
  if (name_max > 0 && path.size() - (slash == std::string::npos ? 0 : slash + 1) > size_t(name_max))
    return "cannot write " + path + ": its name is longer than the " + std::to_string(name_max) + " bytes that folder " + dir + " allows";
  if (stat(path.c_str(), &st) == 0) {
    if (S_ISDIR(st.st_mode)) return "cannot write " + path + ": it is a folder";
    if (access(path.c_str(), W_OK) != 0) return "cannot write " + path + ": the file is not writable";
    if (S_ISFIFO(st.st_mode)) {
      const int fd = ::open(path.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC);
      if (fd < 0)
        return "cannot write " + path + ": " + (errno == ENXIO ? "a FIFO nothing reads from (start its reader first)" : std::strerror(errno));
      *hold = std::shared_ptr<const void>(nullptr, [fd](const void*) { ::close(fd); });
      return "";
    }
  }
  // Written through (a link, a device): no new file in the folder. Else one comes, under a temporary name.
  if (lstat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) return "";
  const std::string probe = dir + "/.ringmaster-probe-" + std::to_string(::getpid());
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) return "cannot write " + path + ": folder " + dir + " takes no new files (" + std::strerror(errno) + ")";
  ::close(fd);
  ::unlink(probe.c_str());
  return "";
}

}  // namespace ringmaster::examples

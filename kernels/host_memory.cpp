#include "kernels/host_memory.hpp"

#include <unistd.h>

#include <charconv>
#include <cstdio>
#include <fstream>
#include <sstream>

namespace ringmaster {
namespace {

// A limit file's first line: a whole number of bytes, or "max" (v2: none). Anything else: none.
bool read_limit(const std::string& path, double* out) {
  std::ifstream f(path);
  std::string line;
  if (!f || !std::getline(f, line)) return false;
  while (!line.empty() && (line.back() == '\n' || line.back() == ' ')) line.pop_back();
  uint64_t v = 0;
  const auto [end, ec] = std::from_chars(line.data(), line.data() + line.size(), v);
  if (ec != std::errc() || end != line.data() + line.size() || line.empty()) return false;
  *out = double(v);
  return true;
}

// Every group from `path` ("/a/b") up to the root ("/a/b", "/a", "/").
template <class F>
void up_from(std::string path, F&& each) {
  if (path.empty() || path[0] != '/' || (path + "/").find("/../") != std::string::npos) return;  // none climbs out
  while (path.size() > 1 && path.back() == '/') path.pop_back();
  for (;;) {
    each(path);
    if (path == "/") return;
    const size_t slash = path.rfind('/');
    path = slash == 0 ? "/" : path.substr(0, slash);
  }
}

}  // namespace

memory_bound usable_memory(double physical, const std::string& proc_cgroup, const std::string& root) {
  memory_bound b;
  b.bytes = physical > 0 ? physical : 0;
  auto consider = [&](const std::string& file, const std::string& group) {
    double v = 0;
    if (read_limit(file, &v) && v > 0 && (b.bytes == 0 || v < b.bytes)) b = memory_bound{v, group};
  };
  // Lines "hierarchy-id:controllers:path": "0::/p" is v2, "4:memory:/p" (or "4:cpu,memory:/p") v1's memory.
  std::istringstream lines(proc_cgroup);
  for (std::string line; std::getline(lines, line);) {
    const size_t a = line.find(':'), c = a == std::string::npos ? a : line.find(':', a + 1);
    if (c == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, c - a - 1), path = line.substr(c + 1);
    bool memory = false;
    std::istringstream names(controllers);
    for (std::string n; std::getline(names, n, ',');) memory = memory || n == "memory";
    // A group's folder under the mount, where it is visible there: inside a container the mount's root is
    // the container's own group, so the outer groups' folders are missing (their caps are seen from the
    // root's own file, which the walk reaches last).
    if (line.compare(0, 3, "0::") == 0)
      up_from(path, [&](const std::string& g) { consider(root + (g == "/" ? "" : g) + "/memory.max", g); });
    else if (memory)
      up_from(path, [&](const std::string& g) { consider(root + "/memory" + (g == "/" ? "" : g) + "/memory.limit_in_bytes", g); });
  }
  return b;
}

memory_bound usable_memory() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  const double physical = pages > 0 && page > 0 ? double(pages) * double(page) : 0;
  std::ifstream f("/proc/self/cgroup");
  std::stringstream text;
  if (f) text << f.rdbuf();
  return usable_memory(physical, text.str(), "/sys/fs/cgroup");
}

std::string describe(const memory_bound& b) {
  char size[32];
  if (b.bytes >= double(1 << 30)) std::snprintf(size, sizeof size, "%.1f GiB", b.bytes / double(1 << 30));
  else std::snprintf(size, sizeof size, "%.0f MiB", b.bytes / double(1 << 20));
  return b.group.empty() ? std::string("this machine's ") + size : std::string("the ") + size + " control group " + b.group + " allows";
}

}  // namespace ringmaster

#include "kernels/host_memory.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <charconv>
#include <cstdint>
#include <cstdio>
#include <sstream>
#include <vector>

namespace ringmaster {
namespace {

// Values at or past this are v1's "no limit" (a page-rounded 2^63 - 1), not a size.
constexpr double kUnlimited = double(uint64_t(1) << 62);

// The start of a small file, read only if it is a regular one: opening a FIFO would block.
std::string head_of(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return "";
  struct stat st {};
  std::string out;
  if (::fstat(fd, &st) == 0 && S_ISREG(st.st_mode)) {
    char buf[16384];  // v1's memory.stat, the longest read, is some 1 KB
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n > 0) out.assign(buf, size_t(n));
  }
  ::close(fd);
  return out;
}

// A whole number of bytes (v2's "max" and anything else: none).
bool parse_bytes(const std::string& text, double* out) {
  uint64_t v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || end != text.data() + text.size() || text.empty()) return false;
  *out = double(v);
  return true;
}

// A limit file's first line.
bool read_limit(const std::string& path, double* out) {
  const std::string text = head_of(path);
  return parse_bytes(text.substr(0, text.find('\n')), out);
}

// v1's memory.stat: its hierarchical_memory_limit line.
bool read_hierarchical_limit(const std::string& path, double* out) {
  std::istringstream lines(head_of(path));
  const std::string key = "hierarchical_memory_limit ";
  for (std::string line; std::getline(lines, line);)
    if (line.compare(0, key.size(), key) == 0) return parse_bytes(line.substr(key.size()), out);
  return false;
}

// mountinfo escapes space, tab, newline and backslash as \ and three octal digits.
std::string unescape(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\\' && i + 3 < s.size() && s[i + 1] >= '0' && s[i + 1] <= '3' &&
        s[i + 2] >= '0' && s[i + 2] <= '7' && s[i + 3] >= '0' && s[i + 3] <= '7') {
      out += char((s[i + 1] - '0') * 64 + (s[i + 2] - '0') * 8 + (s[i + 3] - '0'));
      i += 3;
    } else {
      out += s[i];
    }
  }
  return out;
}

struct cgroup_mount {
  std::string root, point;  // the group the mount shows, and where
  bool v2 = false;
};

// The cgroup2 mount and v1's memory mount, from mountinfo's lines:
// "id parent major:minor root mount-point options [optional fields] - fstype source super-options".
std::vector<cgroup_mount> cgroup_mounts(const std::string& mountinfo) {
  std::vector<cgroup_mount> out;
  std::istringstream lines(mountinfo);
  for (std::string line; std::getline(lines, line);) {
    std::istringstream words(line);
    std::vector<std::string> w;
    for (std::string x; words >> x;) w.push_back(x);
    size_t dash = 6;
    while (dash < w.size() && w[dash] != "-") ++dash;
    if (w.size() < 6 || dash + 1 >= w.size()) continue;
    const std::string& type = w[dash + 1];
    bool memory = false;
    if (type == "cgroup" && dash + 3 < w.size()) {
      std::istringstream opts(w[dash + 3]);
      for (std::string o; std::getline(opts, o, ',');) memory = memory || o == "memory";
    }
    if (type == "cgroup2" || memory) out.push_back({unescape(w[3]), unescape(w[4]), type == "cgroup2"});
  }
  return out;
}

// Whether `group` is `root` or below it; *rest: what follows root ("" or "/a/b").
bool below(const std::string& group, const std::string& root, std::string* rest) {
  if (root == "/") return *rest = group == "/" ? "" : group, true;
  if (group.compare(0, root.size(), root) != 0 || (group.size() > root.size() && group[root.size()] != '/')) return false;
  *rest = group.substr(root.size());
  return true;
}

}  // namespace

memory_bound usable_memory(double physical, const std::string& proc_cgroup, const std::string& mountinfo) {
  memory_bound b;
  b.bytes = physical > 0 ? physical : 0;
  auto consider = [&](double v, const std::string& group) {
    if (v > 0 && v < kUnlimited && (b.bytes == 0 || v < b.bytes)) b = memory_bound{v, group};
  };
  const std::vector<cgroup_mount> mounts = cgroup_mounts(mountinfo);
  // Lines "hierarchy-id:controllers:path": "0::/p" is v2, "4:memory:/p" (or "4:cpu,memory:/p") v1's memory.
  std::istringstream lines(proc_cgroup);
  for (std::string line; std::getline(lines, line);) {
    const size_t a = line.find(':'), c = a == std::string::npos ? a : line.find(':', a + 1);
    if (c == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, c - a - 1);
    std::string group = line.substr(c + 1);
    if (group.empty() || group[0] != '/' || (group + "/").find("/../") != std::string::npos) continue;  // none climbs out
    while (group.size() > 1 && group.back() == '/') group.pop_back();
    bool memory = false;
    std::istringstream names(controllers);
    for (std::string n; std::getline(names, n, ',');) memory = memory || n == "memory";
    const bool v2 = line.compare(0, 3, "0::") == 0;
    if (!v2 && !memory) continue;
    for (const cgroup_mount& m : mounts) {
      std::string rest;
      if (m.v2 != v2 || !below(group, m.root, &rest)) continue;
      // Our group's folder under the mount, then each above it, up to the mount's own (its root group).
      for (std::string r = rest;;) {
        const std::string dir = m.point + r, name = m.root == "/" ? (r.empty() ? "/" : r) : m.root + r;
        double v = 0;
        if (read_limit(dir + (v2 ? "/memory.max" : "/memory.limit_in_bytes"), &v)) consider(v, name);
        if (!v2 && r == rest && read_hierarchical_limit(dir + "/memory.stat", &v)) consider(v, name);
        if (r.empty()) break;
        r = r.substr(0, r.rfind('/'));
      }
    }
  }
  return b;
}

memory_bound usable_memory() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  const double physical = pages > 0 && page > 0 ? double(pages) * double(page) : 0;
  auto whole = [](const char* path) {  // /proc files report a size of 0: read until the end
    std::string out;
    if (FILE* f = std::fopen(path, "re")) {
      char buf[4096];
      for (size_t n; (n = std::fread(buf, 1, sizeof buf, f)) > 0;) out.append(buf, n);
      std::fclose(f);
    }
    return out;
  };
  return usable_memory(physical, whole("/proc/self/cgroup"), whole("/proc/self/mountinfo"));
}

std::string describe(const memory_bound& b) {
  char size[32];
  if (b.bytes >= double(1 << 30)) std::snprintf(size, sizeof size, "%.1f GiB", b.bytes / double(1 << 30));
  else std::snprintf(size, sizeof size, "%.0f MiB", b.bytes / double(1 << 20));
  if (b.group.empty()) return std::string("this machine's ") + size;
  // "/" with a limit is the root of a cgroup namespace: a container's own group.
  if (b.group == "/") return std::string("the ") + size + " this container's control group allows";
  return std::string("the ") + size + " control group " + b.group + " allows";
}

}  // namespace ringmaster

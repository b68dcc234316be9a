#include "kernels/safetensors.hpp"

#include "kernels/registry.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>

namespace ringmaster {

bool write_safetensors(const std::string& path, const model& m, const std::vector<float>& params,
                       const std::map<std::string, std::string>& metadata, std::string* error) {
  if (params.size() != m.param_count()) {
    *error = "parameter count " + std::to_string(params.size()) + " does not match model " + m.label();
    return false;
  }
  json h = json::object();
  json meta = json::object();
  for (const auto& [k, v] : metadata) meta[k] = v;
  if (!meta.contains("model")) meta["model"] = m.description();
  h["__metadata__"] = meta;
  // The flat buffer's order is the tensors' order, so the data is the buffer as it is.
  for (const param_entry& p : m.params())
    h[p.name] = {{"dtype", "F32"}, {"shape", p.dims}, {"data_offsets", {p.offset * 4, (p.offset + p.count) * 4}}};
  std::string text = h.dump();
  while (text.size() % 8) text += ' ';  // the data starts 8-byte aligned
  unsigned char len[8];
  const uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) len[i] = (unsigned char)(n >> (8 * i));
  return write_output(path, {{len, 8}, {text.data(), text.size()}, {params.data(), params.size() * sizeof(float)}}, error);
}

namespace {

// Writes every piece to fd; false with *saved the errno when one fails.
bool write_pieces(int fd, const std::vector<std::pair<const void*, size_t>>& pieces, int* saved) {
  for (const auto& [data, bytes] : pieces) {
    const char* p = static_cast<const char*>(data);
    for (size_t left = bytes; left > 0;) {
      const ssize_t w = ::write(fd, p, std::min<size_t>(left, size_t(1) << 30));
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) return *saved = w < 0 ? errno : ENOSPC, false;
      p += w, left -= size_t(w);
    }
  }
  return true;
}

}  // namespace

bool write_whole(const std::string& path, const std::vector<std::pair<const void*, size_t>>& pieces, std::string* error,
                 mode_t mode) {
  int saved = 0;
  // A fresh file of our own, named for this process and call: two runs saving to one path each rename a
  // whole file of theirs (the last one stays), and a link planted under a name we would use is refused
  // (O_EXCL | O_NOFOLLOW), never written through.
  std::random_device rd;
  char tag[32];
  std::snprintf(tag, sizeof tag, ".%d-%08x.tmp", int(::getpid()), unsigned(rd()));
  // In path's folder, and no longer a name than its folder takes (path's own cut to fit, leaving room for
  // the tag): a name that fits there is written under a temporary one that does too.
  const size_t slash = path.rfind('/'), base = slash == std::string::npos ? 0 : slash + 1;
  const std::string dir = slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
  const long limit = ::pathconf(dir.c_str(), _PC_NAME_MAX);
  const size_t name_max = limit > 64 ? size_t(limit) : 255;
  const size_t keep = std::min(path.size() - base, name_max - std::strlen(tag));
  const std::string tmp = path.substr(0, base + keep) + tag;
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode);
  if (fd < 0) return *error = tmp + ": cannot create: " + std::strerror(errno), false;
  bool ok = write_pieces(fd, pieces, &saved);
  if (ok && ::fsync(fd) != 0) saved = errno, ok = false;
  if (::close(fd) != 0 && ok) saved = errno, ok = false;
  if (!ok) {
    ::unlink(tmp.c_str());
    return *error = tmp + ": write failed: " + std::strerror(saved) + (saved == ENOSPC || saved == EDQUOT ? " (disk full?)" : ""), false;
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    *error = path + ": cannot rename the written file into place: " + std::strerror(errno);
    ::unlink(tmp.c_str());
    return false;
  }
  // The rename itself is durable once the folder is.
  if (const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC); dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
  return true;
}

int own_stream(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0)
    for (int out : {STDOUT_FILENO, STDERR_FILENO}) {
      struct stat o {};
      if (::fstat(out, &o) == 0 && o.st_dev == st.st_dev && o.st_ino == st.st_ino) return out;
    }
  return -1;
}

std::string foreign_output(const std::string& path) {
  const auto others = [](const struct stat& s) { return s.st_uid != ::geteuid() && s.st_uid != 0; };
  // Our own stdout or stderr (/dev/stdout into a pipe another user made: sudo -u ... | jq) is ours to write.
  if (own_stream(path) >= 0) return "";
  struct stat st {};
  if (::lstat(path.c_str(), &st) == 0 && (S_ISLNK(st.st_mode) || S_ISFIFO(st.st_mode)) && others(st))
    return std::string("it is a ") + (S_ISLNK(st.st_mode) ? "link" : "FIFO") + " of another user's (uid " + std::to_string(st.st_uid) +
           "), which could lead the output anywhere: remove it, or name another path";
  if (::stat(path.c_str(), &st) == 0 && S_ISFIFO(st.st_mode) && others(st))
    return "it leads to a FIFO of another user's (uid " + std::to_string(st.st_uid) + "): name another path";
  return "";
}

bool write_output(const std::string& path, const std::vector<std::pair<const void*, size_t>>& pieces, std::string* error) {
  if (std::string why = foreign_output(path); !why.empty()) return *error = path + ": " + why, false;
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0 || S_ISREG(st.st_mode)) {
    // Our own file, new or replaced whole: a report made private stays so (the umask still applies).
    return write_whole(path, pieces, error, S_ISREG(st.st_mode) ? st.st_mode & 0777 : 0644);
  }
  // Our own stdout or stderr (/dev/stdout, /proc/self/fd/1), whatever it is: written at its place in
  // the stream, after what is buffered; opened afresh it would be truncated, or overwritten later.
  if (const int out = own_stream(path); out >= 0) {
    std::fflush(out == STDOUT_FILENO ? stdout : stderr);
    int saved = 0;
    return write_pieces(out, pieces, &saved) ? true : (*error = path + ": write failed: " + std::strerror(saved), false);
  }
  // A link (a file kept elsewhere) or a FIFO: written through, as the user pointed it. Not waiting for a
  // FIFO's reader to come: none there is an error.
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_NONBLOCK | O_CLOEXEC, 0644);
  if (fd < 0) return *error = path + ": cannot open for writing: " + std::strerror(errno), false;
  // Looked at again once open, before anything is cut or written: another user's link planted since the
  // first look, or one swapped for something else since the open, is not written through.
  struct stat opened {}, named {};
  if (std::string why = foreign_output(path); !why.empty() || ::fstat(fd, &opened) != 0 || ::stat(path.c_str(), &named) != 0 ||
                                              opened.st_dev != named.st_dev || opened.st_ino != named.st_ino) {
    ::close(fd);
    return *error = path + ": " + (why.empty() ? "changed while it was opened: not written" : why), false;
  }
  if (S_ISREG(opened.st_mode) && ::ftruncate(fd, 0) != 0) {
    const int e = errno;
    ::close(fd);
    return *error = path + ": cannot cut it short: " + std::strerror(e), false;
  }
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  int saved = 0;
  bool ok = write_pieces(fd, pieces, &saved);
  if (::close(fd) != 0 && ok) saved = errno, ok = false;
  return ok ? true : (*error = path + ": write failed: " + std::strerror(saved), false);
}

bool read_safetensors(const std::string& path, const model& m, std::vector<float>* params, std::string* error) {
  // Mapped, not read: a file may hold other tensors too, and only the model's are copied out.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  struct stat st {};
  if (fd < 0 || ::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    if (fd >= 0) ::close(fd);
    *error = path + ": cannot open";
    return false;
  }
  const size_t size = size_t(st.st_size);
  void* bytes = size ? ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0) : nullptr;
  ::close(fd);  // the mapping stays valid without the descriptor
  if (bytes == MAP_FAILED) {
    *error = path + ": cannot read (" + std::strerror(errno) + ")";
    return false;
  }
  const bool ok = read_safetensors_bytes(path, bytes, size, m, params, error);
  if (bytes) ::munmap(bytes, size);
  return ok;
}

bool read_safetensors_bytes(const std::string& name, const void* bytes, size_t size, const model& m,
                            std::vector<float>* params, std::string* error) {
  const auto* file = static_cast<const unsigned char*>(bytes);
  if (size < 8 || !file) {
    *error = name + ": truncated: no safetensors header";
    return false;
  }
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = n << 8 | file[i];
  if (n > (1u << 24) || n > size - 8) {
    *error = name + ": header length " + std::to_string(n) + " is implausible for a file of " + std::to_string(size) + " bytes";
    return false;
  }
  const std::string text(reinterpret_cast<const char*>(file + 8), size_t(n));
  // Our files nest 4 deep; a crafted one could nest deep enough to overflow the stack when copied.
  if (json_depth(text) > 8) {
    *error = name + ": the header nests deeper than a safetensors header does";
    return false;
  }
  // A parsed value costs far more than its text: bound the count too (~8 per tensor is what we write).
  if (json_items(text) > (size_t(1) << 20)) {
    *error = name + ": the header holds more keys and values than a model's safetensors header does";
    return false;
  }
  std::string twice;
  const json h = parse_json(text, &twice);
  if (h.is_discarded() || !h.is_object()) {
    *error = name + ": the header is not a JSON object";
    return false;
  }
  if (!twice.empty()) {  // which of the two would be the weights?
    *error = name + ": the header names " + ringmaster::quoted(twice) + " twice";
    return false;
  }
  const unsigned char* data = file + 8 + n;
  const uint64_t data_bytes = size - 8 - n;
  params->assign(m.param_count(), 0.0f);
  for (const param_entry& p : m.params()) {
    auto t = h.find(p.name);
    if (t == h.end() || !t->is_object()) {
      *error = name + ": no tensor " + p.name + " (model " + m.label() + ")";
      return false;
    }
    // operator[] on a const json is undefined for a missing key: look up, or an empty value.
    const json none;
    auto field = [&](const char* k) -> const json& { auto it = t->find(k); return it == t->end() ? none : *it; };
    const json &dtype = field("dtype"), &dims = field("shape"), &offs = field("data_offsets");
    if (!dtype.is_string() || dtype.get_ref<const std::string&>() != "F32") {
      *error = name + ": tensor " + p.name + " is not F32";
      return false;
    }
    bool same = dims.is_array() && dims.size() == p.dims.size();
    for (size_t i = 0; same && i < p.dims.size(); ++i)
      same = dims[i].is_number_unsigned() && dims[i].get<uint64_t>() == p.dims[i];
    if (!same) {
      *error = name + ": tensor " + p.name + " has shape " + dims.dump().substr(0, 60) + ", the model needs " +
               json(p.dims).dump();
      return false;
    }
    if (!offs.is_array() || offs.size() != 2 || !offs[0].is_number_unsigned() || !offs[1].is_number_unsigned() ||
        offs[1].get<uint64_t>() < offs[0].get<uint64_t>() || offs[1].get<uint64_t>() > data_bytes ||
        offs[1].get<uint64_t>() - offs[0].get<uint64_t>() != p.count * 4) {
      *error = name + ": tensor " + p.name + " has bad data_offsets " + offs.dump().substr(0, 60);
      return false;
    }
    std::memcpy(params->data() + p.offset, data + offs[0].get<uint64_t>(), p.count * 4);
  }
  return true;
}

}  // namespace ringmaster

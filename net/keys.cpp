#include "net/keys.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <net/if.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <sstream>
#include <zmq.h>

namespace ringmaster::net {
namespace {

bool fail(std::string* error, std::string what) {
  if (error) *error = std::move(what);
  return false;
}

std::string sys_error(const std::string& what) { return what + ": " + std::strerror(errno); }

// Like ssh's StrictModes: what decides whom we trust must be ours and writable by us only, or someone
// else could add their key. A missing file passes unless it must exist.
bool check_private(const std::string& path, bool must_exist, std::string* error) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return (errno == ENOENT && !must_exist) || fail(error, sys_error("cannot stat " + path));
  // A link is named with what it points to, and no chmod is advised for it: that would change its
  // target (/dev/null, /tmp) for everyone.
  struct stat ls {};
  const bool link = ::lstat(path.c_str(), &ls) == 0 && S_ISLNK(ls.st_mode);
  std::string shown = path;
  if (link) {
    char* real = ::realpath(path.c_str(), nullptr);
    shown += " (a link to " + std::string(real ? real : "?") + ")";
    std::free(real);
  }
  if (!S_ISREG(st.st_mode) && !S_ISDIR(st.st_mode))
    return fail(error, shown + " is not a regular file: refusing to read it");
  if (st.st_uid != ::geteuid())
    return fail(error, shown + " belongs to another user (uid " + std::to_string(st.st_uid) + "): refusing to trust it");
  if (st.st_mode & 022)
    return fail(error, shown + " is writable by " + ((st.st_mode & 022) == 020 ? "its group" : "others") +
                           ": refusing to trust it" +
                           (link ? "" : " (chmod go-w " + path + ")"));
  return true;
}

// The folder a file is in: "." for a bare name, "/" for one in the root.
std::string folder_of(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, std::max<size_t>(slash, 1));
}

// The first word of a line, or "" for a blank or comment line.
std::string first_word(const std::string& line, std::string* rest = nullptr) {
  std::istringstream in(line);
  std::string w;
  in >> w;
  if (w.empty() || w[0] == '#') return "";
  if (rest) {
    *rest = "";
    in >> *rest;
  }
  return w;
}

// The largest key file we read: an authorized_keys of some 80,000 keys.
constexpr off_t kMaxKeyFileBytes = off_t(4) << 20;

// The whole file as text; false with *error if it cannot be read (a missing file is `missing`). Only a
// regular file: the node reads authorized_keys at every handshake, on its bridge thread, and a FIFO put
// in its place (O_NONBLOCK keeps open() from waiting for a writer) or a device must not hang it there.
bool read_text(const std::string& path, std::string* text, bool* missing, std::string* error) {
  *missing = false;
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    *missing = errno == ENOENT;
    return *missing || fail(error, sys_error("cannot read " + path));
  }
  struct closer {
    int fd;
    ~closer() { ::close(fd); }
  } close_fd{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0) return fail(error, sys_error("cannot stat " + path));
  if (!S_ISREG(st.st_mode)) return fail(error, path + " is not a regular file: refusing to read it");
  if (st.st_size > kMaxKeyFileBytes)
    return fail(error, path + " is " + std::to_string(st.st_size) + " bytes, more than a key file holds (" +
                           std::to_string(kMaxKeyFileBytes >> 20) + " MiB at most)");
  text->clear();
  char buf[4096];
  for (ssize_t n; (n = ::read(fd, buf, sizeof buf)) != 0;) {
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return fail(error, sys_error("cannot read " + path));
    if (text->size() + size_t(n) > size_t(kMaxKeyFileBytes)) return fail(error, path + " grew past what a key file holds");
    text->append(buf, size_t(n));
  }
  // A file saved by a Windows editor: its byte-order mark is not part of the first key (its CRLF line
  // ends are whitespace to the readers already).
  if (text->rfind("\xEF\xBB\xBF", 0) == 0) text->erase(0, 3);
  return true;
}

// Writes `text` to a new file next to `path` and links it into place: never a half-written key, and when
// two processes race, the first one's file wins (link fails with EEXIST for the other).
bool write_new(const std::string& path, const std::string& text, mode_t mode, bool* existed, std::string* error) {
  *existed = false;
  std::random_device rd;
  const std::string tmp = path + ".tmp" + std::to_string(getpid()) + "." + std::to_string(rd());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, mode);
  if (fd < 0) return fail(error, sys_error("cannot create " + tmp));
  const bool ok = ::write(fd, text.data(), text.size()) == ssize_t(text.size()) && ::fsync(fd) == 0;
  const int err = errno;
  ::close(fd);
  if (!ok) {
    ::unlink(tmp.c_str());
    errno = err;
    return fail(error, sys_error("cannot write " + tmp));
  }
  const int rc = ::link(tmp.c_str(), path.c_str());
  const int link_err = errno;
  ::unlink(tmp.c_str());
  if (rc == 0) return true;
  if (link_err == EEXIST) return *existed = true;
  errno = link_err;
  return fail(error, sys_error("cannot create " + path));
}

}  // namespace

bool curve_available() { return zmq_has("curve") != 0; }

std::string default_key_dir() {
  const char* home = std::getenv("HOME");
  return home && *home == '/' ? std::string(home) + "/.ringmaster" : "";
}

bool load_or_create_keys(const std::string& dir, key_pair* out, std::string* error) {
  if (!curve_available()) return fail(error, "this libzmq has no CurveZMQ (built without libsodium); use --insecure");
  if (dir.empty()) {
    const char* home = std::getenv("HOME");
    return fail(error, std::string("no key directory: HOME is ") + (home && *home ? "not an absolute path" : "not set") + "; give --key-dir");
  }
  // Its parents as `mkdir -p` makes them (umask's mode), as --checkpoint-dir's; the key folder itself private
  // ("keys/" names the folder keys, whose parent is the one above).
  std::filesystem::path folder(dir);
  while (!folder.has_filename() && folder.has_relative_path()) folder = folder.parent_path();
  std::error_code ec;
  if (const std::filesystem::path parent = folder.parent_path(); !parent.empty() && !std::filesystem::create_directories(parent, ec) && ec)
    return fail(error, "cannot make key directory " + dir + ": cannot make " + parent.string() + ": " + ec.message());
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) return fail(error, sys_error("cannot make key directory " + dir));
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) return fail(error, dir + " is not a directory");
  if (!check_private(dir, true, error)) return false;
  const std::string key_path = dir + "/key", pub_path = dir + "/key.pub";
  std::string text;
  bool missing = false;
  if (!read_text(key_path, &text, &missing, error)) return false;
  if (missing) {
    char pub[41], sec[41];
    if (zmq_curve_keypair(pub, sec) != 0) return fail(error, "cannot make a key pair: " + std::string(zmq_strerror(zmq_errno())));
    bool existed = false;  // another process made one first: use theirs
    if (!write_new(key_path, std::string(sec) + "\n", 0600, &existed, error)) return false;
    if (!read_text(key_path, &text, &missing, error)) return false;
    if (missing) return fail(error, "cannot read " + key_path + " after making it");
  }
  if (::stat(key_path.c_str(), &st) != 0) return fail(error, sys_error("cannot stat " + key_path));
  // Another user's key, even one only we may read, is a key that user knows: it proves nothing of us.
  if (st.st_uid != ::geteuid())
    return fail(error, key_path + " belongs to another user (uid " + std::to_string(st.st_uid) + "): refusing to use it as our secret key");
  if (st.st_mode & 077) {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", unsigned(st.st_mode & 07777));
    return fail(error, "permissions " + std::string(mode) + " for " + key_path +
                           " are too open: the secret key must be readable by you only (chmod 600 " + key_path + ")");
  }
  const std::string secret = first_word(text);
  if (!is_key(secret)) return fail(error, key_path + " does not hold a Z85 key (40 characters)");
  char pub[41];
  if (zmq_curve_public(pub, secret.c_str()) != 0) return fail(error, key_path + " does not hold a usable key");
  out->secret_key = secret;
  out->public_key = pub;
  // key.pub is derived: (re)write it when missing, refuse one that belongs to another key.
  if (!read_text(pub_path, &text, &missing, error)) return false;
  if (missing) {
    bool existed = false;
    if (!write_new(pub_path, out->public_key + "\n", 0644, &existed, error)) return false;
    if (!existed) return true;
    if (!read_text(pub_path, &text, &missing, error)) return false;
  }
  if (first_word(text) != out->public_key)
    return fail(error, pub_path + " does not belong to " + key_path + " (remove it and it is made again)");
  return true;
}

bool read_authorized_keys(const std::string& path, std::set<std::string>* keys, std::string* error) {
  keys->clear();
  std::string text;
  bool missing = false;
  // Its folder too, as at start: others who may write it could put a file of their own in its place.
  if (!check_private(folder_of(path), true, error) || !check_private(path, false, error)) return false;
  if (!read_text(path, &text, &missing, error)) return false;
  std::istringstream in(text);
  std::string line;
  for (int n = 1; std::getline(in, line); ++n) {
    const std::string key = first_word(line);
    if (key.empty()) continue;
    if (!is_key(key)) return fail(error, path + ":" + std::to_string(n) + ": not a Z85 public key (40 characters)");
    keys->insert(key);
  }
  return true;
}

const std::string& authorized_keys::refresh() {
  struct stat st {}, dir {};
  const int found = ::stat(path_.c_str(), &st) == 0 ? 1 : -errno;
  const int dir_found = ::stat(folder_of(path_).c_str(), &dir) == 0 ? 1 : -errno;
  const std::array<int64_t, 12> stamp = {found, int64_t(st.st_dev), int64_t(st.st_ino), int64_t(st.st_size),
                                         int64_t(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec,
                                         int64_t(st.st_ctim.tv_sec) * 1000000000 + st.st_ctim.tv_nsec,
                                         int64_t(st.st_mode), int64_t(st.st_uid), int64_t(st.st_nlink),
                                         dir_found, int64_t(dir.st_mode), int64_t(dir.st_uid)};
  const auto now = std::chrono::steady_clock::now();
  if (stamp_ == stamp && now - read_at_ < std::chrono::seconds(5)) return error_;
  stamp_ = stamp;
  read_at_ = now;
  error_.clear();
  if (!read_authorized_keys(path_, &keys_, &error_)) keys_.clear();
  return error_;
}

bool expected_node_key(const std::string& known_nodes, const std::string& endpoint, const std::string& given,
                       const std::string& own, std::string* key, bool* record, std::string* error) {
  *record = false;
  std::string text;
  bool missing = false;
  if (!check_private(known_nodes, false, error)) return false;
  if (!read_text(known_nodes, &text, &missing, error)) return false;
  std::istringstream in(text);
  std::string line, known;
  int known_line = 0;
  for (int n = 1; std::getline(in, line); ++n) {
    std::string k;
    if (first_word(line, &k) != endpoint) continue;
    if (!is_key(k)) return fail(error, known_nodes + ":" + std::to_string(n) + ": not a Z85 public key after " + endpoint);
    // Two lines that disagree (a new key appended, the old one left): which one holds is not ours to guess.
    if (!known.empty() && k != known)
      return fail(error, known_nodes + ":" + std::to_string(known_line) + " and :" + std::to_string(n) + " record different keys for " +
                             endpoint + "; remove the one that is no longer right and try again");
    known = k;
    if (!known_line) known_line = n;
  }
  if (!known.empty() && !given.empty() && given != known)
    return fail(error, "the key given for " + endpoint + " differs from the one recorded in " + known_nodes + ":" +
                           std::to_string(known_line) + ". Someone may be impersonating that node, or it has a new "
                           "key; if you expected this, remove that line and try again");
  if (!known.empty()) return *key = known, true;
  if (!given.empty()) return *key = given, *record = true, true;
  *key = own;
  return true;
}

bool record_known_node(const std::string& known_nodes, const std::string& endpoint, const std::string& key,
                       std::string* error) {
  const int fd = ::open(known_nodes.c_str(), O_RDWR | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) return fail(error, sys_error("cannot open " + known_nodes));
  // A file edited by hand may lack its last newline: then ours starts the line.
  struct stat st {};
  char last = '\n';
  if (::fstat(fd, &st) == 0 && st.st_size > 0) (void)!::pread(fd, &last, 1, st.st_size - 1);
  const std::string line = (last == '\n' ? "" : "\n") + endpoint + " " + key + "\n";  // one write: appends do not mix
  const bool ok = ::write(fd, line.data(), line.size()) == ssize_t(line.size());
  const int err = errno;
  ::close(fd);
  errno = err;
  return ok || fail(error, sys_error("cannot write " + known_nodes));
}

bool split_endpoint_key(const std::string& text, std::string* endpoint, std::string* key, std::string* error) {
  // Z85 has '@' in its alphabet and ipc://@name is an abstract socket: a key is the last 40 characters
  // after an '@', nothing else.
  const size_t n = text.size();
  if (n > kKeyChars + 1 && text[n - kKeyChars - 1] == '@' && is_key(std::string_view(text).substr(n - kKeyChars))) {
    *endpoint = text.substr(0, n - kKeyChars - 1);
    *key = text.substr(n - kKeyChars);
    return true;
  }
  if (text.rfind("tcp://", 0) == 0 && text.find('@') != std::string::npos)
    return fail(error, "'" + text + "': the part after '@' is not a Z85 public key (40 characters)");
  *endpoint = text;
  key->clear();
  return true;
}

bool check_endpoint(const std::string& endpoint, bool any_port, std::string* error) {
  // Plans and known_nodes carry endpoints as printable ASCII; a host name in another script has an
  // ASCII form (xn--...).
  const bool ipc = endpoint.rfind("ipc://", 0) == 0;
  for (unsigned char c : endpoint)
    if (c <= ' ' || c == 0x7f || (c > 0x7f && !ipc))
      return fail(error, "'" + endpoint + "': " + (ipc ? "a path without spaces or control characters"
                                                       : "an endpoint is printable ASCII without spaces (write a host name in its ASCII form, xn--...)"));
  if (endpoint.rfind("ipc://", 0) == 0)
    return endpoint.size() > 6 ? true : fail(error, "'" + endpoint + "' names no path");
  if (endpoint.rfind("tcp://", 0) != 0) return fail(error, "'" + endpoint + "' is not a tcp:// or ipc:// endpoint");
  const size_t colon = endpoint.rfind(':');
  const std::string host = endpoint.substr(6, colon - 6), port = endpoint.substr(colon + 1);
  if (colon < 6 || host.empty()) return fail(error, "'" + endpoint + "' is not tcp://HOST:PORT");
  // tcp://::1:5601 reads to ZeroMQ as an interface named "::1" ("No such device").
  if (host.find(':') != std::string::npos && (host.front() != '[' || host.back() != ']'))
    return fail(error, "'" + endpoint + "': write an IPv6 address in brackets, tcp://[" +
                           (host.front() == '[' ? host.substr(1) : host) + "]:" + port);
  if (port == "*" && any_port) return true;  // ZeroMQ's own word for any free port
  const std::string range = any_port ? "0-65535 (0 or *: any free port)" : "1-65535";
  long value = 0;
  for (char c : port) {
    if (c < '0' || c > '9' || value > 65535) return fail(error, "'" + endpoint + "': the port is not a number in " + range);
    value = value * 10 + (c - '0');
  }
  if (port.empty() || value > 65535 || (value == 0 && !any_port))
    return fail(error, "'" + endpoint + "': the port must be a number in " + range);
  // 017601 is 17601 to the socket but another endpoint to known_nodes and to a check for a node given twice.
  if (port.size() > 1 && port[0] == '0') return fail(error, "'" + endpoint + "': write the port without leading zeros");
  return true;
}

bool check_host_resolves(const std::string& endpoint, std::string* error) {
  if (endpoint.rfind("tcp://", 0) != 0) return true;
  std::string host = endpoint.substr(6, endpoint.rfind(':') - 6);
  if (const size_t semi = host.rfind(';'); semi != std::string::npos) host.erase(0, semi + 1);  // tcp://eth0;HOST:P
  if (host.size() > 2 && host.front() == '[') return true;  // an IPv6 address
  in_addr a4{};
  if (host == "*" || inet_pton(AF_INET, host.c_str(), &a4) == 1) return true;
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &found);
  if (found) ::freeaddrinfo(found);
  if (rc == EAI_NONAME || rc == EAI_NODATA)
    return fail(error, "'" + endpoint + "': no host is named '" + host + "' (the name does not resolve)");
  return true;
}

std::string address_toward(const std::string& endpoint) {
  if (endpoint.rfind("tcp://", 0) != 0 || endpoint.rfind(':') <= 6) return "";
  std::string host = endpoint.substr(6, endpoint.rfind(':') - 6);
  if (const size_t semi = host.rfind(';'); semi != std::string::npos) host.erase(0, semi + 1);  // tcp://eth0;HOST:P
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  addrinfo hints{};
  hints.ai_socktype = SOCK_DGRAM;
  // IPv4 but for an IPv6 address: ZeroMQ reaches a name over IPv4 (without ZMQ_IPV6), so the route
  // that matters is that one, whatever address a dual-stack name lists first.
  in6_addr a6{};
  hints.ai_family = inet_pton(AF_INET6, host.c_str(), &a6) == 1 ? AF_INET6 : AF_INET;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host.c_str(), "9", &hints, &found) != 0 || !found) return "";
  std::string out;
  // A UDP socket "connected" there sends nothing: the kernel only picks the route, and its source address.
  const int fd = ::socket(found->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  sockaddr_storage me{};
  socklen_t len = sizeof me;
  char text[INET6_ADDRSTRLEN] = {};
  if (fd >= 0 && ::connect(fd, found->ai_addr, found->ai_addrlen) == 0 && ::getsockname(fd, reinterpret_cast<sockaddr*>(&me), &len) == 0) {
    if (me.ss_family == AF_INET && inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(&me)->sin_addr, text, sizeof text))
      out = text;
    else if (me.ss_family == AF_INET6 && inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(&me)->sin6_addr, text, sizeof text) &&
             reinterpret_cast<sockaddr_in6*>(&me)->sin6_scope_id == 0)  // a link-local one needs its interface: none
      out = "[" + std::string(text) + "]";
  }
  if (fd >= 0) ::close(fd);
  ::freeaddrinfo(found);
  return out;
}

bool check_listen_host(const std::string& endpoint, std::string* error) {
  if (endpoint.rfind("tcp://", 0) != 0) return true;
  std::string host = endpoint.substr(6, endpoint.rfind(':') - 6);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  // A scoped IPv6 address, fe80::1%eth0: the address and its interface.
  if (const size_t pct = host.find('%'); pct != std::string::npos && host.find(':') < pct) {
    if (if_nametoindex(host.substr(pct + 1).c_str()) == 0)
      return fail(error, "'" + host + "': no network interface '" + host.substr(pct + 1) + "' on this machine");
    host.resize(pct);
  }
  in6_addr a6{};
  in_addr a4{};
  const bool v4 = inet_pton(AF_INET, host.c_str(), &a4) == 1, v6 = !v4 && inet_pton(AF_INET6, host.c_str(), &a6) == 1;
  if (v4 || v6) {
    // An address of another machine (a typo, or the address of the machine one came from) would fail
    // later, in whichever socket binds first, with "Cannot assign requested address": name it now.
    // Scoped addresses are left to ZeroMQ: their interface was checked above.
    if (endpoint.find('%') != std::string::npos) return true;
    sockaddr_storage sa{};
    socklen_t len = 0;
    if (v4) {
      auto* a = reinterpret_cast<sockaddr_in*>(&sa);
      a->sin_family = AF_INET;
      a->sin_addr = a4;
      len = sizeof *a;
    } else {
      auto* a = reinterpret_cast<sockaddr_in6*>(&sa);
      a->sin6_family = AF_INET6;
      a->sin6_addr = a6;
      len = sizeof *a;
    }
    const int fd = ::socket(sa.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    // No socket of that family at all (IPv6 off): no address of it is ours. Other failures (no file
    // descriptors left) prove nothing: ZeroMQ will say what it finds.
    const bool here = fd < 0 ? errno != EAFNOSUPPORT
                             : ::bind(fd, reinterpret_cast<const sockaddr*>(&sa), len) == 0 || errno != EADDRNOTAVAIL;
    if (fd >= 0) ::close(fd);
    if (!here)
      return fail(error, "'" + host + "' is not an address of this machine (listen on one of its own addresses, 0.0.0.0, * "
                         "or an interface such as eth0)");
    return true;
  }
  if (host == "*" || if_nametoindex(host.c_str()) != 0) return true;
  return fail(error, "'" + host + "' is neither an IP address nor a network interface of this machine (listen on 127.0.0.1, "
                     "0.0.0.0, * or eth0, say: ZeroMQ does not listen on a host name)");
}

}  // namespace ringmaster::net

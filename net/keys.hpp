// Keys for CurveZMQ links, kept the way ssh keeps its own.
//
// A key directory (default ~/.ringmaster, --key-dir on every program) holds:
//   key              this program's secret key, Z85 text (40 characters); mode 0600, made on first use
//   key.pub          its public key, Z85 text: give it to whoever must trust you
//   authorized_keys  (daemons) public keys allowed to command this daemon, one per line; a daemon always
//                    accepts its own key, so processes sharing one directory (a shared home) need no setup
//   known_nodes      (launchers) "ENDPOINT KEY" lines: the keys we expect from daemons. A key given on the
//                    command line (--nodes tcp://h:p@KEY) is recorded on first use; a different one later
//                    is refused, as ssh refuses a changed host key.
// Lines may end in a comment after the key; blank lines and lines starting with '#' are ignored.
//
// These functions read and write files only; errors name the file (and line) and say what is wrong.
#pragma once
#include <array>
#include <chrono>
#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <string_view>

namespace ringmaster::net {

constexpr size_t kKeyChars = 40;  // Z85 text of a 32-byte Curve25519 key

struct key_pair {
  std::string public_key, secret_key;  // Z85; both empty: no encryption (--insecure)
  bool empty() const { return secret_key.empty(); }
};

// Whether this libzmq was built with CurveZMQ (Debian's is, through libsodium).
bool curve_available();
// A well-formed Z85 key: 40 characters of the Z85 alphabet, each group of 5 below 2^32; its 32 bytes go
// to `out` when given. Inline and free of libzmq, so the job plan's decoder and net/seal.cpp (and their
// fuzzers) can read keys without linking it.
inline bool decode_key(std::string_view text, unsigned char* out = nullptr) {
  constexpr std::string_view z85 = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#";
  if (text.size() != kKeyChars) return false;
  for (size_t g = 0; g < kKeyChars; g += 5) {
    uint64_t value = 0;
    for (size_t i = g; i < g + 5; ++i) {
      const size_t digit = z85.find(text[i]);
      if (digit == std::string_view::npos) return false;
      value = value * 85 + digit;
    }
    if (value >> 32) return false;
    for (int b = 0; out && b < 4; ++b) out[g / 5 * 4 + size_t(b)] = static_cast<unsigned char>(value >> (24 - 8 * b));
  }
  return true;
}
inline bool is_key(std::string_view text) { return decode_key(text); }
// $HOME/.ringmaster; "" without a HOME, or with one that is not an absolute path.
std::string default_key_dir();

// Reads DIR/key (and checks DIR/key.pub against it), making DIR (0700) and a new pair on first use. Two
// processes starting at once end up with the same pair. Refuses a secret key others may read.
bool load_or_create_keys(const std::string& dir, key_pair* out, std::string* error);

// The keys listed in an authorized_keys file; a missing file is an empty list. The file and its folder
// must be ours and writable by us only (ssh's StrictModes), each time it is read.
bool read_authorized_keys(const std::string& path, std::set<std::string>* keys, std::string* error);

// A daemon's authorized_keys while it runs, so that keys can be added and revoked meanwhile: read again
// when the file's stat changes (a copy that keeps the old mtime still gets a new ctime and inode) or its
// folder's owner or mode does, and every 5 s regardless (a file system whose times are too coarse to show
// an edit). A file refused is no list at all: keeping the last one would keep a key just revoked working.
// One thread's.
class authorized_keys {
 public:
  explicit authorized_keys(std::string path = "") : path_(std::move(path)) {}
  // Reads the file if it may have changed: "" or why it is refused (then it holds no key).
  const std::string& refresh();
  // The next refresh() reads the file whatever its stat says (a stat, then a read just after the file
  // was emptied in place, would otherwise stand until its times change).
  void read_again() { stamp_.reset(); }
  bool contains(const std::string& key) const { return keys_.count(key) > 0; }
  size_t size() const { return keys_.size(); }
  const std::string& error() const { return error_; }

 private:
  std::string path_;
  std::set<std::string> keys_;
  std::string error_;
  std::optional<std::array<int64_t, 12>> stamp_;  // the file's and its folder's stat when last read
  std::chrono::steady_clock::time_point read_at_;
};

// The key to expect from the daemon at `endpoint`. `given` (from the command line, may be empty) must agree
// with known_nodes, or the call fails with an ssh-like warning; without either, the daemon is expected to
// share our key (`own`). *record: the key is new and should be added to known_nodes once the daemon answers.
bool expected_node_key(const std::string& known_nodes, const std::string& endpoint, const std::string& given,
                       const std::string& own, std::string* key, bool* record, std::string* error);
// Appends "ENDPOINT KEY" to known_nodes.
bool record_known_node(const std::string& known_nodes, const std::string& endpoint, const std::string& key,
                       std::string* error);

// Splits "tcp://host:port@KEY" into endpoint and key ("" when there is no "@KEY"). False if a key is given
// but malformed.
bool split_endpoint_key(const std::string& text, std::string* endpoint, std::string* key, std::string* error);

// An endpoint as a user types it: tcp://HOST:PORT (PORT 1-65535, or 0 or * where any_port: the system picks one)
// or ipc://PATH. False, saying why, for anything else (a port of 99999 would wrap to another one).
bool check_endpoint(const std::string& endpoint, bool any_port, std::string* error);

// Whether a tcp:// endpoint's host name resolves (getaddrinfo, which may wait for DNS): a launcher asks
// about a node that did not answer, to name a typo as such. Failures other than "no such name" pass.
bool check_host_resolves(const std::string& endpoint, std::string* error);

// This machine's address toward a tcp:// endpoint's host, for a peer there to reach us back: that of the
// interface the route there leaves by ("10.0.0.5"; IPv6 in brackets); "" when unknown (ipc://, no route,
// a name that does not resolve). Sends nothing.
std::string address_toward(const std::string& endpoint);

// An endpoint (checked as above) that ZeroMQ can listen on: its host is *, an IP address of this machine
// or a network interface of it. ZeroMQ does not bind to host names ("localhost": "No such device").
bool check_listen_host(const std::string& endpoint, std::string* error);

}  // namespace ringmaster::net

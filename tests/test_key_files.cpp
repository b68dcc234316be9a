// Key files as the daemon and the launcher read them (net/keys.hpp): what they refuse, and when.
#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>

#include "net/keys.hpp"
#include "tests/test_util.hpp"

using namespace ringmaster;
using namespace std::chrono_literals;

namespace {

std::string temp_dir() { return test::temp_dir("keyfiles"); }

std::string fresh_key(const std::string& dir) {
  net::key_pair kp;
  std::string err;
  REQUIRE(net::load_or_create_keys(dir, &kp, &err));
  return kp.public_key;
}

}  // namespace

TEST_CASE("keys: a daemon's authorized_keys is read again as it changes, and refused while its folder is open to others", "[keys]") {
  const std::string dir = temp_dir(), file = dir + "/authorized_keys";
  const std::string alice = fresh_key(dir + "/alice"), bob = fresh_key(dir + "/bob");
  std::ofstream(file) << alice << "\n";
  net::authorized_keys keys(file);
  REQUIRE(keys.refresh() == "");
  CHECK((keys.contains(alice) && !keys.contains(bob) && keys.size() == 1));
  // An edit (here: one that keeps the size, so only the times and inode say it) is read at the next refresh.
  std::ofstream(file + ".new") << bob << "\n";
  std::filesystem::rename(file + ".new", file);
  CHECK(keys.refresh() == "");
  CHECK((keys.contains(bob) && !keys.contains(alice)));
  // Its folder made writable by others while the daemon runs (anyone could then put their own file in
  // its place): refused at once, with no key in it, as it would be at start; and read again once fixed.
  REQUIRE(chmod(dir.c_str(), 0777) == 0);
  CHECK(keys.refresh() == dir + " is writable by others: refusing to trust it (chmod go-w " + dir + ")");
  CHECK((!keys.contains(bob) && keys.size() == 0));
  CHECK(keys.error() == dir + " is writable by others: refusing to trust it (chmod go-w " + dir + ")");
  std::set<std::string> read;
  std::string err;
  CHECK_FALSE(net::read_authorized_keys(file, &read, &err));
  CHECK(err == keys.error());
  REQUIRE(chmod(dir.c_str(), 0700) == 0);
  CHECK(keys.refresh() == "");
  CHECK(keys.contains(bob));
  // The file itself opened to others: the same.
  REQUIRE(chmod(file.c_str(), 0666) == 0);
  CHECK(keys.refresh() == file + " is writable by others: refusing to trust it (chmod go-w " + file + ")");
  CHECK(keys.size() == 0);
}

TEST_CASE("a key file that is a FIFO or a device is refused at once, not waited on") {
  // The node reads authorized_keys at every handshake, on its bridge thread: a FIFO in its place (no
  // writer ever comes) must not hang it, nor /dev/zero fill its memory.
  const std::string dir = temp_dir();
  REQUIRE(mkfifo((dir + "/authorized_keys").c_str(), 0600) == 0);
  std::set<std::string> keys;
  std::string err;
  const auto t0 = std::chrono::steady_clock::now();
  CHECK_FALSE(net::read_authorized_keys(dir + "/authorized_keys", &keys, &err));
  CHECK(err == dir + "/authorized_keys is not a regular file: refusing to read it");
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(1));
  std::string key;
  bool record = false;
  REQUIRE(mkfifo((dir + "/known_nodes").c_str(), 0600) == 0);
  CHECK_FALSE(net::expected_node_key(dir + "/known_nodes", "tcp://10.0.0.1:5601", "", "", &key, &record, &err));
  CHECK(err == dir + "/known_nodes is not a regular file: refusing to read it");
  // A link (ssh's known_hosts -> /dev/null idiom) is named with its target, and no chmod is advised that
  // would change /dev/null, or /tmp, for everyone.
  const std::string links = temp_dir();
  REQUIRE(symlink("/dev/null", (links + "/known_nodes").c_str()) == 0);
  CHECK_FALSE(net::expected_node_key(links + "/known_nodes", "tcp://10.0.0.1:5601", "", "", &key, &record, &err));
  CHECK(err == links + "/known_nodes (a link to /dev/null) is not a regular file: refusing to read it");
  const std::string open_dir = temp_dir();
  REQUIRE(chmod(open_dir.c_str(), 0777) == 0);
  REQUIRE(symlink(open_dir.c_str(), (links + "/keys").c_str()) == 0);
  net::key_pair kp;
  CHECK_FALSE(net::load_or_create_keys(links + "/keys", &kp, &err));
  CHECK(err == links + "/keys (a link to " + std::filesystem::canonical(open_dir).string() + ") is writable by others: refusing to trust it");
}

TEST_CASE("keys: without a HOME to default to, the error says which is wrong and asks for --key-dir", "[keys]") {
  const char* was = std::getenv("HOME");
  const std::string home = was ? was : "";
  net::key_pair kp;
  std::string err;
  ::unsetenv("HOME");
  CHECK(net::default_key_dir().empty());
  CHECK_FALSE(net::load_or_create_keys(net::default_key_dir(), &kp, &err));
  CHECK(err == "no key directory: HOME is not set; give --key-dir");
  ::setenv("HOME", "relative/home", 1);
  CHECK_FALSE(net::load_or_create_keys(net::default_key_dir(), &kp, &err));
  CHECK(err == "no key directory: HOME is not an absolute path; give --key-dir");
  if (was) ::setenv("HOME", home.c_str(), 1);
  else ::unsetenv("HOME");
}

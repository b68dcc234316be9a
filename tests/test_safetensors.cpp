// safetensors files (kernels/safetensors.hpp): read back from a path and from memory with damage named,
// a failed write leaves the old file and no .tmp, a user's file keeps its mode, links and FIFOs are handled.
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kernels/model.hpp"
#include "kernels/safetensors.hpp"
#include "tests/test_util.hpp"

using namespace ringmaster;
using namespace ringmaster::test;

TEST_CASE("safetensors: a file reads back from its path and from memory, damage is named", "[layers]") {
  std::string err;
  auto m = build_model("4-3-2", shape{4, 1, 1}, &err);
  REQUIRE(m);
  const std::vector<float> params = init_params(*m, 7);
  const std::string path = "/tmp/ringmaster-test-" + std::to_string(::getpid()) + ".safetensors";
  REQUIRE(write_safetensors(path, *m, params, {}, &err));
  std::vector<float> back;
  REQUIRE(read_safetensors(path, *m, &back, &err));
  CHECK(back == params);
  std::FILE* f = std::fopen(path.c_str(), "rb");
  REQUIRE(f);
  std::vector<unsigned char> file(1 << 16);
  file.resize(std::fread(file.data(), 1, file.size(), f));
  std::fclose(f);
  std::remove(path.c_str());
  back.clear();
  REQUIRE(read_safetensors_bytes("mem", file.data(), file.size(), *m, &back, &err));
  CHECK(back == params);
  // Cut anywhere, the file is refused with its name: never a read past its end.
  for (size_t cut : {size_t(0), size_t(7), size_t(8), size_t(100), file.size() - 1}) {
    INFO("cut at " << cut);
    CHECK_FALSE(read_safetensors_bytes("mem", file.data(), cut, *m, &back, &err));
    CHECK(err.rfind("mem: ", 0) == 0);
  }
  CHECK_FALSE(read_safetensors_bytes("mem", file.data(), file.size() - 1, *m, &back, &err));
  CHECK(err == "mem: tensor dense_1/bias has bad data_offsets [84,92]");
  CHECK_FALSE(read_safetensors("/nonexistent/w.safetensors", *m, &back, &err));
  CHECK(err == "/nonexistent/w.safetensors: cannot open");
  CHECK_FALSE(read_safetensors("/tmp", *m, &back, &err));  // a folder is no file
  CHECK(err == "/tmp: cannot open");
}

TEST_CASE("safetensors: a write that fails half way (disk full) leaves the old file as it was, and no .tmp", "[layers]") {
  std::string err;
  auto small = build_model("4-3-2", shape{4, 1, 1}, &err), big = build_model("64-64-10", shape{64, 1, 1}, &err);
  REQUIRE(small);
  REQUIRE(big);
  const std::string path = "/tmp/ringmaster-test-full-" + std::to_string(::getpid()) + ".safetensors";
  REQUIRE(write_safetensors(path, *small, init_params(*small, 7), {}, &err));
  const std::string before = test::slurp(path);
  REQUIRE(before.size() < 4096);
  // Files of this process may grow to 4 KiB: a disk that fills while the 17 KB of weights go out.
  rlimit old{}, cap{};
  REQUIRE(getrlimit(RLIMIT_FSIZE, &old) == 0);
  cap = old;
  cap.rlim_cur = 4096;
  auto* old_handler = std::signal(SIGXFSZ, SIG_IGN);
  REQUIRE(setrlimit(RLIMIT_FSIZE, &cap) == 0);
  const bool wrote = write_safetensors(path, *big, init_params(*big, 7), {}, &err);
  setrlimit(RLIMIT_FSIZE, &old);
  std::signal(SIGXFSZ, old_handler);
  CHECK_FALSE(wrote);
  CHECK(err.rfind(path + ".", 0) == 0);
  CHECK(err.find(".tmp: write failed: ") != std::string::npos);
  CHECK(test::slurp(path) == before);
  CHECK(::access(err.substr(0, err.find(".tmp: ") + 4).c_str(), F_OK) != 0);  // no litter
  // Written whole, the new one replaces it; to a device (here /dev/full) there is nothing to rename.
  REQUIRE(write_safetensors(path, *big, init_params(*big, 7), {}, &err));
  std::vector<float> back;
  CHECK(read_safetensors(path, *big, &back, &err));
  std::remove(path.c_str());
  CHECK_FALSE(write_safetensors("/dev/full", *small, init_params(*small, 7), {}, &err));
  CHECK(err == "/dev/full: write failed: No space left on device");
}

TEST_CASE("safetensors: a file the user named keeps its mode, a link is written through, a FIFO without a reader is an error", "[layers]") {
  std::string err;
  auto m = build_model("4-3-2", shape{4, 1, 1}, &err);
  REQUIRE(m);
  const std::vector<float> params = init_params(*m, 7);
  const std::string dir = "/tmp/ringmaster-test-out-" + std::to_string(::getpid());
  REQUIRE(::mkdir(dir.c_str(), 0700) == 0);
  // A private file stays private when written again.
  const std::string file = dir + "/w.safetensors";
  REQUIRE(write_safetensors(file, *m, params, {}, &err));
  REQUIRE(::chmod(file.c_str(), 0600) == 0);
  REQUIRE(write_safetensors(file, *m, params, {}, &err));
  struct stat st {};
  REQUIRE(::stat(file.c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0600);
  // A link (as /dev/stdout is) stays a link, and its target gets the weights.
  const std::string target = dir + "/kept-elsewhere", link = dir + "/link.safetensors";
  REQUIRE(::symlink(target.c_str(), link.c_str()) == 0);
  REQUIRE(write_safetensors(link, *m, params, {}, &err));
  REQUIRE(::lstat(link.c_str(), &st) == 0);
  CHECK(S_ISLNK(st.st_mode));
  std::vector<float> back;
  CHECK(read_safetensors(target, *m, &back, &err));
  CHECK(back == params);
  // A FIFO nobody reads: an error at once, not a wait.
  const std::string fifo = dir + "/fifo";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  CHECK_FALSE(write_safetensors(fifo, *m, params, {}, &err));
  CHECK(err == fifo + ": cannot open for writing: No such device or address");
  for (const std::string& f : {file, target, link, fifo}) std::remove(f.c_str());
  ::rmdir(dir.c_str());
}

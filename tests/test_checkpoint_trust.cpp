// Whose files a run trusts: a checkpoint folder or file another user owns, or may write, is not resumed
// from (as ssh's StrictModes refuses such key files), the folder's lock is ours alone, and outputs are not
// written through another user's link or FIFO.
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <filesystem>
#include <string>

#include "actors/checkpoint.hpp"
#include "kernels/safetensors.hpp"
#include "tests/checkpoint_util.hpp"

using namespace ringmaster;
using namespace ringmaster::checkpoint_test;

namespace {

mode_t mode_of(const std::string& path) {
  struct stat st {};
  REQUIRE(::stat(path.c_str(), &st) == 0);
  return st.st_mode & 07777;
}

}  // namespace

TEST_CASE("checkpoint: a resume refuses a folder or a checkpoint that another user owns or may write", "[checkpoint]") {
  // Another user's folder in /tmp holding a forged checkpoint (its CRC-32 recomputed) was resumed from,
  // exit 0, its weights saved as ours; a lock file others could read, they could hold for ever.
  const std::string dir = fresh_dir("trust");
  const std::string job = "--epochs 1 --batch 64 --model 784-16-10 --limit-train 256 --limit-test 64 -q --checkpoint-dir " + dir;
  const run_result first = mnist(job);
  INFO(first.out);
  REQUIRE(first.status == 0);
  const std::string ckpt = dir + "/ckpt-1-0.safetensors";
  CHECK(mode_of(dir + "/.ringmaster-lock") == 0600);

  REQUIRE(::chmod(dir.c_str(), 0777) == 0);
  CHECK(check_checkpoint_dir(dir, true) ==
        dir + " is writable by its group or by others, who could put checkpoints of theirs there: chmod go-w " + dir + ", or give a folder of your own");
  run_result r = mnist(job + " --resume");
  INFO(r.out);
  CHECK(r.status == 2);
  CHECK(r.out.find("--checkpoint-dir: " + dir + " is writable by its group or by others") != std::string::npos);
  REQUIRE(::chmod(dir.c_str(), 0755) == 0);

  // A file others may write is not resumed from: with no other, the resume is refused, not trained anew.
  REQUIRE(::chmod(ckpt.c_str(), 0666) == 0);
  checkpoint c;
  std::string err;
  CHECK_FALSE(read_checkpoint(ckpt, layer_registry::with_builtins(), &c, &err));
  CHECK(err == ckpt + ": writable by its group or by others: not trusted as a checkpoint (chmod go-w " + ckpt + ")");
  r = mnist(job + " --resume");
  CHECK(r.status != 0);
  CHECK(r.out.find(ckpt + ": writable by its group or by others: not trusted as a checkpoint") != std::string::npos);
  CHECK(r.out.find("Resuming from") == std::string::npos);
  REQUIRE(::chmod(ckpt.c_str(), 0644) == 0);
  REQUIRE(read_checkpoint(ckpt, layer_registry::with_builtins(), &c, &err));

  if (geteuid() == 0) {  // root can give them away (CI runs as root)
    REQUIRE(::chown(ckpt.c_str(), 4242, -1) == 0);
    CHECK_FALSE(read_checkpoint(ckpt, layer_registry::with_builtins(), &c, &err));
    CHECK(err == ckpt + ": belongs to another user (uid 4242): not trusted as a checkpoint");
    REQUIRE(::chown(ckpt.c_str(), 0, -1) == 0);
    REQUIRE(::chown(dir.c_str(), 4242, -1) == 0);  // in /tmp, anyone's to write: it could be anyone's folder
    CHECK(check_checkpoint_dir(dir, true) ==
          dir + " belongs to another user (uid 4242), who could put checkpoints of theirs there: give a folder of your own");
    CHECK(check_checkpoint_dir(dir + "/", true).rfind(dir + "/ belongs to another user (uid 4242)", 0) == 0);
    REQUIRE(::chown(dir.c_str(), 0, -1) == 0);
    // Root (a container, sudo) in a user's own folder, where every folder above it is theirs or root's
    // and nobody else's to write (not under /tmp: /root here): theirs, and their files, are trusted.
    const std::string home = "/root/ringmaster-test-trust-" + std::to_string(getpid());
    fs::create_directories(home + "/ck");
    REQUIRE(::chown(home.c_str(), 4242, -1) == 0);
    REQUIRE(::chown((home + "/ck").c_str(), 4242, -1) == 0);
    REQUIRE(::chmod(home.c_str(), 0755) == 0);
    CHECK(check_checkpoint_dir(home + "/ck", false) == "");
    fs::copy_file(ckpt, home + "/ck/ckpt-1-0.safetensors");
    REQUIRE(::chown((home + "/ck/ckpt-1-0.safetensors").c_str(), 4242, -1) == 0);
    CHECK(read_checkpoint(home + "/ck/ckpt-1-0.safetensors", layer_registry::with_builtins(), &c, &err));
    // A folder above it anyone's to write: a folder or a link could be swapped in between the check and
    // the read (a race let a forged checkpoint in, 2 of 25 tries), so neither is trusted.
    REQUIRE(::chmod(home.c_str(), 0777) == 0);
    CHECK(check_checkpoint_dir(home + "/ck", true) ==
          home + "/ck belongs to another user (uid 4242), who could put checkpoints of theirs there: give a folder of your own");
    CHECK_FALSE(read_checkpoint(home + "/ck/ckpt-1-0.safetensors", layer_registry::with_builtins(), &c, &err));
    CHECK(err == home + "/ck/ckpt-1-0.safetensors: belongs to another user (uid 4242): not trusted as a checkpoint");
    fs::remove_all(home);
    // Under /tmp, anyone's to write, a user's folder and files are not trusted.
    fs::create_directories(dir + "/theirs");
    REQUIRE(::chown((dir + "/theirs").c_str(), 4242, -1) == 0);
    CHECK_FALSE(check_checkpoint_dir(dir + "/theirs", true).empty());
    fs::remove_all(dir + "/theirs");
  } else {
    WARN("not root: the checks of a folder and a checkpoint owned by another user need to give them away");
  }
  // Trusted again, it resumes (trained to its end: nothing more to train).
  r = mnist(job + " --resume");
  CHECK(r.status == 0);
  CHECK(r.out.find("Resuming from " + ckpt) != std::string::npos);

  // A lock file of an earlier release (0644) is made ours alone; a folder made under a umask of 002 is
  // not writable by the group.
  REQUIRE(::chmod((dir + "/.ringmaster-lock").c_str(), 0644) == 0);
  CHECK(check_checkpoint_dir(dir, true).empty());
  CHECK(mode_of(dir + "/.ringmaster-lock") == 0600);
  const mode_t was = ::umask(002);
  CHECK(check_checkpoint_dir(dir + "/made/here", false).empty());
  ::umask(was);
  CHECK((mode_of(dir + "/made/here") & 022) == 0);
  fs::remove_all(dir);
}

TEST_CASE("outputs: a link or FIFO of another user's is not written through", "[launcher]") {
  // Another user's link in a shared folder led --report-json (exit 0) over a file of ours it pointed at,
  // and --save into a folder only we may write; its FIFO, held open and never read, hung the launcher
  // after training.
  if (geteuid() != 0) {
    WARN("not root: a link and a FIFO of another user's need root to give them away");
    return;
  }
  const std::string dir = fresh_dir("foreign-outputs");
  const std::string victim = dir + "/victim.txt", link = dir + "/run.json", fifo = dir + "/w.safetensors";
  write_bytes(victim, "ours");
  REQUIRE(::symlink(victim.c_str(), link.c_str()) == 0);
  REQUIRE(::lchown(link.c_str(), 4242, 4242) == 0);
  REQUIRE(::mkfifo(fifo.c_str(), 0666) == 0);
  REQUIRE(::chown(fifo.c_str(), 4242, 4242) == 0);
  const std::string job = "--epochs 1 --batch 64 --model 784-16-10 --limit-train 256 --limit-test 64 -q";
  run_result r = mnist(job + " --report-json " + link);
  INFO(r.out);
  CHECK(r.status == 2);
  CHECK(r.out.find("--report-json: cannot write " + link + ": it is a link of another user's (uid 4242), which could lead the output anywhere") !=
        std::string::npos);
  r = mnist(job + " --save " + fifo);
  INFO(r.out);
  CHECK(r.status == 2);
  CHECK(r.out.find("cannot write " + fifo + ": it is a FIFO of another user's (uid 4242)") != std::string::npos);
  CHECK(slurp(victim) == "ours");
  // Written at the end as checked at the start: one planted after the check is refused then too.
  std::string err;
  const std::string text = "{}";
  CHECK_FALSE(write_output(link, {{text.data(), text.size()}}, &err));
  CHECK(err == link + ": it is a link of another user's (uid 4242), which could lead the output anywhere: remove it, or name another path");
  CHECK(slurp(victim) == "ours");
  // Our own stdout is ours to write, whoever made the pipe it is (sudo -u svc ... | jq).
  const std::string got = dir + "/got.txt";
  r = test::run("cat " + fifo + " > " + got + " & " + RINGMASTER_MNIST_BIN + " " + job + " --report-json /dev/stdout > " + fifo + "; wait");
  INFO(r.out);
  CHECK(r.status == 0);
  CHECK(slurp(got).find("\"test_accuracy\"") != std::string::npos);
  // Root's own links (/dev/stdout) and ours are written through as before.
  REQUIRE(::lchown(link.c_str(), 0, 0) == 0);
  REQUIRE(write_output(link, {{text.data(), text.size()}}, &err));
  CHECK(slurp(victim) == "{}");
  fs::remove_all(dir);
}

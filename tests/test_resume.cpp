// --resume through the real launcher: runs killed after a checkpoint and resumed, locally, go on to the
// uninterrupted run's weights bit for bit; folders, flags and files that are not this job's are refused.
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <catch2/catch.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "actors/checkpoint.hpp"
#include "kernels/safetensors.hpp"
#include "tests/checkpoint_util.hpp"

using namespace ringmaster;
using namespace ringmaster::checkpoint_test;

TEST_CASE("checkpoint: a local run killed after a checkpoint resumes to the uninterrupted run's weights, bit for bit",
          "[checkpoint][launcher]") {
  const std::string dir = fresh_dir("local"), out = fresh_dir("local-out");
  // 16 steps an epoch, 48 in all.
  const std::string job = "--replicas 2 --epochs 3 --batch 64 --model 784-64-10 --limit-train 1024 --limit-test 256";
  run_result full = mnist(job + " --save " + out + "/full.st --report-json " + out + "/full.json");
  INFO(full.out);
  REQUIRE(full.status == 0);
  REQUIRE(fnv(full.out).size() == 16);
  {  // The summary's checksum is FNV-1a 64 as its authors define it, over the --save'd tensors' bytes in order.
    std::string error;
    std::vector<float> w;
    REQUIRE(read_safetensors(out + "/full.st", *mlp("784-64-10"), &w, &error));
    uint64_t h = 14695981039346656037ull;
    for (size_t i = 0; i < w.size() * sizeof(float); ++i) h = (h ^ reinterpret_cast<const unsigned char*>(w.data())[i]) * 1099511628211ull;
    char hex[17];
    std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(h));
    CHECK(fnv(full.out) == hex);
  }

  // Mid-epoch: checkpoints after steps 5, 10, 15, 20; killed right after writing the one after step 20.
  run_result crash = mnist(job + " --checkpoint-dir " + dir + " --checkpoint-every 5 --crash-after-checkpoint 4");
  INFO(crash.out);
  CHECK(killed(crash));
  CHECK(crash.out.find("Done") == std::string::npos);
  CHECK(names(dir) == std::set<std::string>{"ckpt-0-15.safetensors", "ckpt-1-4.safetensors"});
  run_result resumed = mnist(job + " --checkpoint-dir " + dir + " --checkpoint-every 5 --resume --save " + out +
                             "/resumed.st --report-json " + out + "/resumed.json");
  INFO(resumed.out);
  REQUIRE(resumed.status == 0);
  CHECK(resumed.out.find("Resuming from " + dir + "/ckpt-1-4.safetensors: 1 epoch and 4 of 16 steps done") != std::string::npos);
  // Another seed is refused before the launcher says it resumes (the data is checked once it is loaded).
  run_result other_seed = mnist(job + " --seed 5 --checkpoint-dir " + dir + " --checkpoint-every 5 --resume");
  INFO(other_seed.out);
  CHECK(other_seed.status == 2);
  CHECK(other_seed.out.find("--resume: the checkpoint " + dir + "/ckpt-3-0.safetensors was made with seed 42, this job's is 5") != std::string::npos);
  CHECK(other_seed.out.find("Resuming from") == std::string::npos);
  CHECK(other_seed.out.find("--help") == std::string::npos);  // not a matter of flags
  CHECK(resumed.out.find("Epoch 1/3") == std::string::npos);
  CHECK(resumed.out.find("(resumed at step 4)") != std::string::npos);
  CHECK(resumed.out.find("Done: 3 epochs (resumed after epoch 1, step 4)") != std::string::npos);
  CHECK(fnv(resumed.out) == fnv(full.out));
  CHECK(slurp(out + "/resumed.st") == slurp(out + "/full.st"));
  same_history(out + "/full.json", out + "/resumed.json");  // the resumed epoch's metrics are whole
  // It went on writing there: after step 45 and the last.
  CHECK(names(dir) == std::set<std::string>{"ckpt-2-13.safetensors", "ckpt-3-0.safetensors"});
  CHECK(resumed.out.find("Last checkpoint: " + dir + "/ckpt-3-0.safetensors") != std::string::npos);

  // At epochs' ends (the default), with SGD and dropout (its masks depend on the step): killed after the first.
  const std::string job2 = "--replicas 2 --epochs 2 --batch 64 --optimizer sgd --limit-train 1024 --limit-test 256 --model "
                           "'[{\"type\": \"dense\", \"units\": 32, \"activation\": \"relu\"}, {\"type\": \"dropout\", \"rate\": 0.3},"
                           " {\"type\": \"dense\", \"units\": 10}]'";
  const std::string dir2 = fresh_dir("local-epochs");
  full = mnist(job2);
  REQUIRE(full.status == 0);
  crash = mnist(job2 + " --checkpoint-dir " + dir2 + " --crash-after-checkpoint 1");
  CHECK(killed(crash));
  CHECK(names(dir2) == std::set<std::string>{"ckpt-1-0.safetensors"});
  resumed = mnist(job2 + " --checkpoint-dir " + dir2 + " --resume");
  INFO(resumed.out);
  REQUIRE(resumed.status == 0);
  CHECK(resumed.out.find("Epoch 2/2") != std::string::npos);
  CHECK(fnv(resumed.out) == fnv(full.out));
}

TEST_CASE("checkpoint: --resume in a folder with no checkpoint yet trains from the start, so one command line "
          "serves a batch job's first start and its restarts", "[checkpoint][launcher]") {
  const std::string job = "--replicas 2 --epochs 2 --batch 64 --model 784-32-10 --limit-train 512 --limit-test 128";
  const run_result full = mnist(job);
  REQUIRE(full.status == 0);
  const std::string dir = fresh_dir("requeue");  // made by the batch script, or by a run stopped before its first
  const std::string again = job + " --checkpoint-dir " + dir + " --resume";
  const run_result first = mnist(again);
  INFO(first.out);
  REQUIRE(first.status == 0);
  CHECK(first.out.find("No checkpoint in " + dir + " yet: training from the start") != std::string::npos);
  CHECK(first.out.find("Epoch 1/2") != std::string::npos);
  CHECK(fnv(first.out) == fnv(full.out));
  CHECK(names(dir) == std::set<std::string>{"ckpt-1-0.safetensors", "ckpt-2-0.safetensors"});
  // Started again (requeued after it ended): it finds the last checkpoint and trains nothing.
  const run_result second = mnist(again + " --report-json " + dir + "/report.json");
  INFO(second.out);
  CHECK(second.status == 0);
  CHECK(second.out.find("The run had trained to its end") != std::string::npos);
  CHECK(fnv(second.out) == fnv(full.out));
  CHECK(slurp(dir + "/report.json").find("\"replicas_at_end\": 2,") != std::string::npos);  // as the run's own (it said 1)
  std::remove((dir + "/report.json").c_str());
  // Only damaged checkpoints: refused, not trained over (a fresh run would prune them).
  for (const std::string& name : names(dir)) {
    std::string bytes = slurp(dir + "/" + name);
    bytes[bytes.size() - 3] ^= 0x40;
    std::ofstream(dir + "/" + name, std::ios::binary | std::ios::trunc) << bytes;
  }
  const run_result damaged = mnist(again);
  INFO(damaged.out);
  CHECK(damaged.status == 2);
  CHECK(damaged.out.find("--resume: no checkpoint in " + dir + " reads back whole (2 tried)") != std::string::npos);
  CHECK(damaged.out.find("Epoch") == std::string::npos);
}

TEST_CASE("checkpoint: --resume skips a damaged newest checkpoint for the one before it", "[checkpoint][launcher]") {
  const std::string dir = fresh_dir("damaged");
  const std::string job = "--replicas 2 --epochs 2 --batch 64 --model 784-32-10 --limit-train 1024 --limit-test 256 -q";
  const run_result full = mnist(job);
  REQUIRE(full.status == 0);
  CHECK(killed(mnist(job + " --checkpoint-dir " + dir + " --checkpoint-every 5 --crash-after-checkpoint 3")));
  REQUIRE(names(dir) == std::set<std::string>{"ckpt-0-10.safetensors", "ckpt-0-15.safetensors"});
  std::string bytes = slurp(dir + "/ckpt-0-15.safetensors");
  bytes[bytes.size() - 1000] ^= 0x40;  // one bit of Adam's second moment
  write_bytes(dir + "/ckpt-0-15.safetensors", bytes);
  const run_result resumed = mnist(job + " --checkpoint-dir " + dir + " --checkpoint-every 5 --resume");
  INFO(resumed.out);
  REQUIRE(resumed.status == 0);
  CHECK(resumed.out.find("skipping a checkpoint: " + dir + "/ckpt-0-15.safetensors: checksum") != std::string::npos);
  CHECK(resumed.out.find("Resuming from " + dir + "/ckpt-0-10.safetensors") != std::string::npos);
  CHECK(fnv(resumed.out) == fnv(full.out));

  // The damaged file it passed over is not what it keeps beside its next checkpoint: the one it resumed
  // from is (once, a second damaged file left it nothing to resume from).
  const std::string kept = fresh_dir("damaged-kept");
  CHECK(killed(mnist(job + " --checkpoint-dir " + kept + " --checkpoint-every 5 --crash-after-checkpoint 3")));
  bytes = slurp(kept + "/ckpt-0-15.safetensors");
  bytes[bytes.size() - 1000] ^= 0x40;
  write_bytes(kept + "/ckpt-0-15.safetensors", bytes);
  CHECK(killed(mnist(job + " --checkpoint-dir " + kept + " --checkpoint-every 16 --resume --crash-after-checkpoint 1")));
  CHECK(names(kept) == std::set<std::string>{"ckpt-0-10.safetensors", "ckpt-1-0.safetensors"});

  // Other samples in the same numbers (another data set, a copy that differs): refused, not trained on.
  const run_result other = mnist(job + " --checkpoint-dir " + dir + " --resume --data " + other_data());
  INFO(other.out);
  CHECK(other.status == 2);
  CHECK(other.out.find("--resume: the checkpoint " + dir + "/ckpt-2-0.safetensors was made on other training data: 1024 samples as this job's") != std::string::npos);

  // Nothing readable: exit 2, and no training. Of many files passed over, ten are named and the rest counted.
  for (int i = 0; i < 30; ++i) write_bytes(dir + "/ckpt-0-" + std::to_string(1000 + i) + ".safetensors", "planted");
  for (const auto& f : names(dir)) write_bytes(dir + "/" + f, "not a checkpoint");
  const size_t files = names(dir).size();
  const run_result none = mnist(job + " --checkpoint-dir " + dir + " --resume");
  INFO(none.out);
  CHECK(none.status == 2);
  size_t named = 0;
  for (size_t at = none.out.find("skipping a checkpoint: "); at != std::string::npos; at = none.out.find("skipping a checkpoint: ", at + 1)) ++named;
  CHECK(named == 10);
  CHECK(none.out.find("skipping " + std::to_string(files - 10) + " more checkpoints that do not read back whole") != std::string::npos);
  CHECK(none.out.find("--resume: no checkpoint in " + dir + " reads back whole") != std::string::npos);
  CHECK(none.out.find("Done") == std::string::npos);
}

TEST_CASE("checkpoint: an unwritable folder or a misused flag exits 2 before training", "[checkpoint][launcher]") {
  struct bad {
    std::string args, says;
  };
  const std::string empty = fresh_dir("empty");
  const std::string fifo = empty + "/report.fifo";  // nothing reads it: once found after training
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  // Links to nothing are written through at the end, as a shell's `>` does: to a folder not there, or
  // in a loop, they cannot be (once found only after training).
  const std::string nowhere = empty + "/nowhere.json", loop = empty + "/loop.json";
  REQUIRE(::symlink("/nonexistent/run.json", nowhere.c_str()) == 0);
  REQUIRE(::symlink(loop.c_str(), loop.c_str()) == 0);
  const std::vector<bad> cases = {
      {"--report-json " + nowhere, "--report-json: cannot write " + nowhere + ": it links to /nonexistent/run.json, which cannot be made (No such file or directory)"},
      {"--save " + loop, "--save: cannot write " + loop + ": its links go round in a loop"},
      {"--report-json " + fifo, "--report-json: cannot write " + fifo + ": a FIFO nothing reads from (start its reader first)"},
      {"--save " + fifo, "--save: cannot write " + fifo + ": a FIFO nothing reads from"},
      {"--checkpoint-dir /etc/hostname/ck", "--checkpoint-dir: cannot create folder /etc/hostname/ck: Not a directory"},
      {"--checkpoint-dir /etc/hostname", "--checkpoint-dir: /etc/hostname is not a folder"},
      {"--checkpoint-dir /sys/kernel", "--checkpoint-dir: "},  // not writable, even for root
      {"--checkpoint-every 5", "--checkpoint-every needs --checkpoint-dir"},
      {"--resume", "--resume needs --checkpoint-dir"},
      {"--checkpoint-dir " + empty + " --checkpoint-every 0", "--checkpoint-every must be at least 1"},
      // A folder not there (a typo): nothing to resume, and none is made.
      {"--checkpoint-dir " + empty + "/typo --resume", "--checkpoint-dir: there is no folder " + empty + "/typo, so no checkpoint to resume from"},
      // Names ckpt-* in the folder are the job's: weights saved so would be overwritten or pruned as a
      // checkpoint; so too in a folder not made yet.
      {"--checkpoint-dir " + empty + " --save " + empty + "/ckpt-1-0.safetensors",
       "--save " + empty + "/ckpt-1-0.safetensors is a checkpoint's name in --checkpoint-dir"},
      {"--checkpoint-dir " + empty + "/new/ --save " + empty + "/new/ckpt-9-0.safetensors", "is a checkpoint's name in --checkpoint-dir " + empty + "/new"},
      {"--checkpoint-dir " + empty + "/ --report-json " + empty + "/./ckpt-2-0.safetensors.tmp", "--report-json " + empty + "/./ckpt-2-0.safetensors.tmp is a checkpoint's name"},
      // The folder itself, made only as the run starts: once found as "Is a directory" after training.
      {"--checkpoint-dir " + empty + "/made --save " + empty + "/made/", "--save " + empty + "/made/ names the --checkpoint-dir folder"},
      {"--checkpoint-dir " + empty + "/made2 --report-json " + empty + "/made2", "names the --checkpoint-dir folder"},
      // A name longer than the folder allows: once found only after training, as its temporary file's.
      {"--save " + empty + "/" + std::string(256, 'w'), "its name is longer than the 255 bytes that folder " + empty + " allows"},
      // A folder access() calls writable (for root) that takes no files: once found only after training.
      {"--save /proc/weights.safetensors", "cannot write /proc/weights.safetensors: "},
  };
  for (const bad& b : cases) {
    const run_result r = mnist("--epochs 1 --limit-train 256 --limit-test 64 " + b.args);
    INFO(b.args << "\n" << r.out);
    CHECK(r.status == 2);
    CHECK(r.out.find(b.says) != std::string::npos);
    CHECK(r.out.find("Epoch") == std::string::npos);  // nothing trained
  }
  CHECK(access((empty + "/typo").c_str(), F_OK) != 0);
  // With its reader there the run goes ahead (the report is smaller than the pipe's buffer: it waits
  // there for the reader, which holds the read end open from before the run).
  const int rfd = ::open(fifo.c_str(), O_RDONLY | O_NONBLOCK);
  REQUIRE(rfd >= 0);
  const run_result ok = mnist("--epochs 1 --limit-train 256 --limit-test 64 -q --report-json " + fifo);
  std::string got;
  char buf[4096];
  for (ssize_t n; (n = ::read(rfd, buf, sizeof buf)) > 0;) got.append(buf, size_t(n));
  ::close(rfd);
  CHECK(ok.status == 0);
  CHECK(got.find("\"test_accuracy\"") != std::string::npos);
  CHECK(got.find("\"unmeasured_samples\"") != std::string::npos);
  // A link to a file not made yet, in a folder that is there: the check leaves nothing behind, and the
  // report lands in that file, the link kept.
  const std::string target = empty + "/made-by-run.json", link = empty + "/run.json";
  REQUIRE(::symlink(target.c_str(), link.c_str()) == 0);
  const run_result through = mnist("--epochs 1 --limit-train 256 --limit-test 64 -q --no-eval --report-json " + link);
  INFO(through.out);
  CHECK(through.status == 0);
  struct stat st {};
  CHECK((::lstat(link.c_str(), &st) == 0 && S_ISLNK(st.st_mode)));
  CHECK(slurp(target).find("\"history\"") != std::string::npos);
  CHECK(names(empty).count("made-by-run.json") == 1);
  // A relative link names a file beside the link, not in our working folder.
  const std::string rel = empty + "/rel.json";
  REQUIRE(::symlink("made-rel.json", rel.c_str()) == 0);
  const run_result relative = mnist("--epochs 1 --limit-train 256 --limit-test 64 -q --no-eval --report-json " + rel);
  INFO(relative.out);
  CHECK(relative.status == 0);
  CHECK(slurp(empty + "/made-rel.json").find("\"history\"") != std::string::npos);
  // A checkpoint folder is made with its parents, as mkdir -p (it was refused: "No such file or directory").
  const run_result nested = mnist("--epochs 1 --limit-train 256 --limit-test 64 -q --no-eval --checkpoint-dir " + empty + "/a/b");
  INFO(nested.out);
  CHECK(nested.status == 0);
  CHECK(names(empty + "/a/b").count("ckpt-1-0.safetensors") == 1);
}

TEST_CASE("checkpoint: a --save that fails after training still leaves the report, and names the checkpoint that "
          "holds the weights", "[checkpoint][launcher]") {
  // /dev/full takes the check before training (a device, written through, that takes writes), and every
  // write to it fails.
  const std::string dir = fresh_dir("save-fails");
  const run_result r = mnist("--epochs 1 --limit-train 256 --limit-test 64 --save /dev/full --checkpoint-dir " + dir +
                             "/ck --report-json " + dir + "/run.json");
  INFO(r.out);
  CHECK(r.status == 1);
  CHECK(r.out.find("--save /dev/full was not written: /dev/full: write failed: No space left on device") != std::string::npos);
  CHECK(r.out.find("the final weights are in the last checkpoint, " + dir + "/ck/ckpt-1-0.safetensors: run again with --resume") !=
        std::string::npos);
  const auto report = nlohmann::json::parse(slurp(dir + "/run.json"));
  CHECK(report["epochs"] == 1);
  CHECK(report["history"].size() == 1);
  // Resumed from that finished checkpoint, which trains nothing: the same hint, naming it.
  const run_result again = mnist("--epochs 1 --limit-train 256 --limit-test 64 --save /dev/full --checkpoint-dir " + dir + "/ck --resume");
  INFO(again.out);
  CHECK(again.status == 1);
  CHECK(again.out.find("the final weights are in the last checkpoint, " + dir + "/ck/ckpt-1-0.safetensors: run again with --resume") !=
        std::string::npos);
  CHECK(again.out.find("Last checkpoint: " + dir + "/ck/ckpt-1-0.safetensors") != std::string::npos);
  fs::remove_all(dir);

  // Not root (nobody, where we are root): outputs written through need only be writable themselves, not
  // their folder (/dev takes no files of nobody's), and our own stdout is written as it is.
  const std::string as_user = geteuid() == 0 ? "setpriv --reuid=65534 --regid=65534 --clear-groups " : "";
  const run_result user = test::run(as_user + RINGMASTER_MNIST_BIN + " --epochs 1 --limit-train 256 --limit-test 64 -q "
                                    "--save /dev/null --report-json /dev/stdout");
  INFO(user.out);
  CHECK(user.status == 0);
  CHECK(user.out.find("\"test_accuracy\"") != std::string::npos);
  // Another user's file in /tmp, writable by all: the sticky bit keeps it from being replaced, which the
  // check says before training (once found as EPERM after it).
  if (geteuid() == 0) {
    const std::string theirs = "/tmp/ringmaster-theirs-" + std::to_string(getpid()) + ".json";
    write_bytes(theirs, "{}");
    REQUIRE(::chmod(theirs.c_str(), 0666) == 0);
    const run_result sticky = test::run(as_user + RINGMASTER_MNIST_BIN + " --epochs 1 --limit-train 256 --limit-test 64 -q --report-json " + theirs);
    INFO(sticky.out);
    CHECK(sticky.status == 2);
    CHECK(sticky.out.find("cannot write " + theirs + ": it belongs to another user") != std::string::npos);
    CHECK(sticky.out.find("Done") == std::string::npos);
    std::remove(theirs.c_str());
  }
}

TEST_CASE("checkpoint: one run a folder, outputs into a folder made for checkpoints and under long names, and a "
          "message under a file-size limit", "[checkpoint][launcher]") {
  const std::string dir = fresh_dir("locked");
  const std::string job = "--epochs 1 --batch 64 --model 784-16-10 --limit-train 256 --limit-test 64 -q";
  {
    // Another run holds the folder (as this test process now does): two would prune each other's files.
    std::shared_ptr<const void> lock;
    REQUIRE(check_checkpoint_dir(dir, false, &lock).empty());
    const run_result r = mnist(job + " --checkpoint-dir " + dir);
    INFO(r.out);
    CHECK(r.status == 2);
    CHECK(r.out.find("--checkpoint-dir: another run is using folder " + dir) != std::string::npos);
    CHECK(names(dir).empty());
  }
  // Let go (as a run that ends, or dies, lets go): the folder takes a run again, and an output in it.
  run_result r = mnist(job + " --checkpoint-dir " + dir + "/new --save " + dir + "/new/w.st");
  INFO(r.out);
  CHECK(r.status == 0);
  CHECK(names(dir + "/new") == std::set<std::string>{"ckpt-1-0.safetensors", "w.st"});
  // A name of 255 bytes, the most a folder takes: its temporary file's name is cut to fit.
  const std::string longest = dir + "/" + std::string(252, 'w') + ".st";
  r = mnist(job + " --save " + longest);
  INFO(r.out);
  CHECK(r.status == 0);
  CHECK(fs::file_size(longest) > 0);
  // Over a file-size limit (ulimit -f): a write that fails with a message, not a signal, and leaves
  // neither a temporary file nor a file that is not whole.
  fs::remove(longest);
  r = test::run("ulimit -f 16; " + std::string(RINGMASTER_MNIST_BIN) + " " + job + " --save " + dir + "/big.st");
  INFO(r.out);
  CHECK(r.status == 1);
  CHECK(r.out.find("write failed: File too large") != std::string::npos);
  CHECK(names(dir) == std::set<std::string>{"new"});
}

TEST_CASE("checkpoint: --resume refuses another model with exit 2, and a finished run goes on with more epochs",
          "[checkpoint][launcher]") {
  const std::string dir = fresh_dir("refuse");
  const std::string data = " --batch 64 --limit-train 512 --limit-test 128 -q --checkpoint-dir " + dir;
  REQUIRE(mnist("--epochs 1 --model 784-32-10" + data).status == 0);
  REQUIRE(names(dir) == std::set<std::string>{"ckpt-1-0.safetensors"});
  run_result r = mnist("--epochs 2 --model 784-16-10 --resume" + data);
  INFO(r.out);
  CHECK(r.status == 2);
  CHECK(r.out.find("--resume: the checkpoint " + dir + "/ckpt-1-0.safetensors was made for model 784-32-10, this job's is 784-16-10") != std::string::npos);
  CHECK(r.out.find("skipping a checkpoint") == std::string::npos);  // said once, as the refusal
  CHECK(r.out.find("Done") == std::string::npos);
  // Two epochs in two runs are two epochs in one.
  r = mnist("--epochs 2 --model 784-32-10 --resume" + data);
  CHECK(r.status == 0);
  const run_result whole = mnist("--epochs 2 --model 784-32-10" + data.substr(0, data.find(" --checkpoint-dir")));
  CHECK(fnv(r.out) == fnv(whole.out));
  CHECK(fnv(r.out).size() == 16);
}

TEST_CASE("checkpoint: a run killed after its last checkpoint, before its results, finishes on --resume without training",
          "[checkpoint][launcher]") {
  const std::string dir = fresh_dir("last");
  const std::string job = " --model 784-64-10 --epochs 2 --batch 128 --limit-train 1024 --limit-test 128 -q";
  // 8 steps an epoch, a checkpoint after each: the 16th is the job's last step.
  run_result r = mnist(job + " --checkpoint-every 1 --checkpoint-dir " + dir + " --save " + dir + "/w --crash-after-checkpoint 16");
  REQUIRE(killed(r));
  REQUIRE(!fs::exists(dir + "/w"));
  r = mnist(job + " --checkpoint-every 1 --checkpoint-dir " + dir + " --save " + dir + "/w --resume");
  INFO(r.out);
  CHECK(r.status == 0);
  CHECK(r.out.find("The run had trained to its end: nothing left to train, its results are written from the checkpoint "
                   "(its test metrics as that run measured them, on its test set)") != std::string::npos);
  CHECK(r.out.find("weights from the checkpoint (fnv1a64 ") != std::string::npos);
  const run_result whole = mnist(job + " --save " + dir + "/whole");
  REQUIRE(whole.status == 0);
  CHECK(fnv(r.out) == fnv(whole.out));
  CHECK(slurp(dir + "/w") == slurp(dir + "/whole"));
}

TEST_CASE("checkpoint: a new run refuses a folder of another run's checkpoints, and writes through no planted link",
          "[checkpoint][launcher]") {
  const std::string dir = fresh_dir("others");
  const std::string data = " --epochs 1 --batch 64 --limit-train 512 --limit-test 128 -q --checkpoint-dir " + dir;
  REQUIRE(mnist("--model 784-32-10" + data).status == 0);
  const std::string before = slurp(dir + "/ckpt-1-0.safetensors");
  // Without --resume a run would prune them: it stops before training, and they stay.
  run_result r = mnist("--model 784-16-10" + data);
  INFO(r.out);
  CHECK(r.status == 2);
  CHECK(r.out.find("--checkpoint-dir: " + dir + " holds the checkpoints of another run (ckpt-1-0.safetensors), which this "
                   "one would delete: resume from them (--resume), or give another folder") != std::string::npos);
  CHECK(slurp(dir + "/ckpt-1-0.safetensors") == before);

  // A link where the next checkpoint's temporary file goes (a shared folder): the file it points to is
  // left alone, and the checkpoint is written as a file of its own.
  const std::string linked = fresh_dir("linked"), victim = fresh_dir("victim") + "/victim.txt";
  write_bytes(victim, "not yours");
  fs::create_symlink(victim, linked + "/ckpt-1-0.safetensors.tmp");
  r = mnist("--model 784-16-10" + data.substr(0, data.find(" --checkpoint-dir")) + " --checkpoint-dir " + linked);
  CHECK(r.status == 0);
  CHECK(slurp(victim) == "not yours");
  CHECK(fs::is_regular_file(fs::symlink_status(linked + "/ckpt-1-0.safetensors")));
  CHECK(names(linked) == std::set<std::string>{"ckpt-1-0.safetensors", "ckpt-1-0.safetensors.tmp"});  // not a name we write: kept
}

TEST_CASE("checkpoint: a folder named as a checkpoint in the checkpoint folder is refused before a resume trains", "[checkpoint]") {
  // A checkpoint cannot be renamed onto it: every --resume trained up to that step, failed there (exit 1)
  // and lost those steps, for ever.
  const std::string dir = fresh_dir("folder-named-as-checkpoint");
  REQUIRE(std::filesystem::create_directory(dir + "/ckpt-3-0.safetensors"));
  CHECK(check_checkpoint_dir(dir, true, nullptr) ==
        dir + "/ckpt-3-0.safetensors is a folder, named as a checkpoint this run may write: move it out of " + dir);
  std::filesystem::remove(dir + "/ckpt-3-0.safetensors");
  CHECK(check_checkpoint_dir(dir, true, nullptr).empty());
  std::filesystem::remove_all(dir);
}

TEST_CASE("checkpoint: one made for another model is refused before its data is read", "[checkpoint]") {
  const std::string dir = fresh_dir("stranger");
  const std::string data = " --epochs 1 --batch 64 --limit-train 512 --limit-test 128 -q --checkpoint-dir " + dir;
  REQUIRE(mnist("--model 784-32-10" + data).status == 0);
  const std::string path = dir + "/ckpt-1-0.safetensors";
  checkpoint c;
  std::string error;
  bool other = false;
  REQUIRE(read_checkpoint(path, layer_registry::with_builtins(), &c, &error));
  // The job's model as the user gives it: a description that names its input, or one built for the
  // checkpoint's samples.
  const std::string mine = c.model, mine_short = "784-32-10", theirs = "784-16-10";
  // Cut off in its data: read for its own model that is damage, read for another model it is a stranger
  // (its data never looked at).
  fs::resize_file(path, fs::file_size(path) - 100);
  for (const std::string* job : {&mine, &mine_short}) {
    CHECK_FALSE(read_checkpoint(path, layer_registry::with_builtins(), &c, &error, job, &other));
    CHECK_FALSE(other);
    CHECK(error.find("(truncated?)") != std::string::npos);
  }
  // A description that does not build for its samples at all is another model's too.
  const std::string conv = R"([{"type": "conv2d", "filters": 4, "kernel": 29}, {"type": "dense", "units": 10}])";  // not on 28x28
  CHECK_FALSE(read_checkpoint(path, layer_registry::with_builtins(), &c, &error, &conv, &other));
  CHECK(other);
  INFO(error);
  CHECK(error.find("the checkpoint " + path + " was made for model 784-32-10, for whose samples this job's does not build") != std::string::npos);
  CHECK_FALSE(read_checkpoint(path, layer_registry::with_builtins(), &c, &error, &theirs, &other));
  CHECK(other);
  CHECK(error == "the checkpoint " + path + " was made for model 784-32-10, this job's is 784-16-10");
}

TEST_CASE("checkpoint: a damaged file is refused by its checksum before its data is held", "[checkpoint]") {
  // A header for 784-4096-4096-10 (some 20M parameters, 240 MB of state) over a sparse file of that size:
  // it costs nothing to make, and must cost little to refuse.
  const std::string dir = fresh_dir("sparse");
  const auto m = mlp("784-4096-4096-10");
  checkpoint c;
  c.model = m->description();
  c.label = m->label();
  c.fingerprint = m->fingerprint();
  c.seed = 1, c.global_batch = 64, c.replicas = 1, c.train_samples = 640, c.steps_per_epoch = 10, c.epochs = 1;
  c.progress.step = 10;
  c.progress.history.resize(1);
  c.state.steps = 10;
  c.state.params.assign(m->param_count(), 0.0f), c.state.m1 = c.state.params, c.state.m2 = c.state.params;
  std::string path, error;
  REQUIRE(write_checkpoint(dir, *m, c, &path, &error));
  c = checkpoint{};
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekp(-4, std::ios::end);
  f.write("\x01\x02\x03\x04", 4);  // damage at the very end: the whole file must be read to see it
  f.close();
  // The peak memory from here on (Linux: writing 5 to clear_refs starts the high-water mark afresh).
  const auto status_kib = [](const std::string& key) {
    std::ifstream in("/proc/self/status");
    for (std::string line; std::getline(in, line);)
      if (line.rfind(key + ":", 0) == 0) return std::atol(line.c_str() + key.size() + 1);
    return -1L;
  };
  { std::ofstream("/proc/self/clear_refs") << "5"; }
  const long rss = status_kib("VmRSS");
  CHECK_FALSE(read_checkpoint(path, layer_registry::with_builtins(), &c, &error));
  const long peak = status_kib("VmHWM");
  CHECK(error.find(": the file is damaged") != std::string::npos);
  REQUIRE((rss > 0 && peak > 0));
  CHECK(peak - rss < 100 * 1024);  // KiB: far less than the 240 MB it describes
  fs::remove_all(dir);
}

TEST_CASE("checkpoint: a 2-node run killed after a checkpoint resumes at once on its daemons to the same weights",
          "[checkpoint][nodes]") {
  auto start = [] { return test::start_daemons(2, {RINGMASTER_NODE_BIN}, "cpu:1", RINGMASTER_DATA_DIR); };
  const std::string dir = fresh_dir("nodes");
  const std::string job = " --epochs 2 --batch 64 --model 784-64-10 --limit-train 1024 --limit-test 256 -q";
  test::daemons first = start();
  const run_result full = mnist("--nodes " + test::node_list(first) + job);
  INFO(full.out);
  REQUIRE(full.status == 0);
  // Checkpoints after steps 7, 14, 21 (epoch 2, step 5); killed after that one.
  const run_result crash =
      mnist("--nodes " + test::node_list(first) + job + " --checkpoint-dir " + dir + " --checkpoint-every 7 --crash-after-checkpoint 3");
  INFO(crash.out);
  CHECK(killed(crash));
  CHECK(names(dir) == std::set<std::string>{"ckpt-0-14.safetensors", "ckpt-1-5.safetensors"});
  // The daemons drop the dead launcher's job once a message to it fails (within 0.1 s), or once it has
  // been silent for their --launcher-timeout: started at once, as a requeued batch job is, the resume goes
  // on either way (waiting for them, saying so, where they still hold it: test_nodes_liars.cpp).
  const std::string nodes = "--nodes " + test::node_list(first);
  run_result r = mnist(nodes + job.substr(0, job.size() - 3) + " --checkpoint-dir " + dir + " --checkpoint-every 7 --resume");
  INFO(r.out);
  REQUIRE(r.status == 0);
  CHECK(r.out.find("Resuming from " + dir + "/ckpt-1-5.safetensors") != std::string::npos);
  CHECK(fnv(r.out) == fnv(full.out));
  CHECK(fnv(r.out).size() == 16);
  CHECK(names(dir) == std::set<std::string>{"ckpt-1-12.safetensors", "ckpt-2-0.safetensors"});  // after steps 28, 32
  r = mnist(nodes + " --epochs 2 --batch 64 --model 784-32-10 --limit-train 1024 --limit-test 256 -q --checkpoint-dir " + dir +
            " --resume");
  INFO(r.out);
  CHECK(r.status == 2);  // the nodes built another model than the checkpoint's
  CHECK(r.out.find("the checkpoint " + dir + "/ckpt-2-0.safetensors was made for model 784-64-10, this job's is") != std::string::npos);
  // Its last checkpoint is a finished run's: a job of another model or data does not take it as its own
  // (it once wrote that run's weights as its results).
  r = mnist(nodes + " --epochs 2 --batch 64 --model 784-32-10 --limit-train 1024 --limit-test 256 -q --checkpoint-dir " + dir +
            " --resume --save " + dir + "/w");
  INFO(r.out);
  CHECK(r.status == 2);
  CHECK(r.out.find("the checkpoint " + dir + "/ckpt-2-0.safetensors was made for model 784-64-10, this job's is 784-32-10") != std::string::npos);
  r = mnist(nodes + " --epochs 2 --batch 64 --model 784-64-10 --limit-train 512 --limit-test 256 -q --checkpoint-dir " + dir +
            " --resume --save " + dir + "/w");
  INFO(r.out);
  CHECK(r.status == 2);
  // The nodes refuse its plan, and say what is likely wrong.
  CHECK(r.out.find("but this node's 512 training samples make 16 steps in all (a checkpoint made with another --limit-train or data "
                   "set?)") != std::string::npos);
  CHECK(!fs::exists(dir + "/w"));
  // This job's, on its nodes: its results come from the checkpoint, nothing trained.
  r = mnist(nodes + job + " --checkpoint-dir " + dir + " --resume --save " + dir + "/w");
  INFO(r.out);
  CHECK(r.status == 0);
  CHECK(r.out.find("The run had trained to its end") != std::string::npos);
  CHECK(fnv(r.out) == fnv(full.out));
  CHECK(fs::exists(dir + "/w"));
  fs::remove(dir + "/w");
  // Nodes with other samples in the same numbers: neither a job over them and a node of the real data,
  // nor a resume on them alone.
  const std::string other = other_data();
  test::daemons others = test::start_daemons(2, {RINGMASTER_NODE_BIN}, "cpu:1", other);
  r = mnist("--nodes " + first[0]->endpoint + "," + others[0]->endpoint + job);
  INFO(r.out);
  CHECK(r.status == 2);
  CHECK(r.out.find("1024 training samples each, but not the same ones (data fingerprints") != std::string::npos);
  r = mnist("--nodes " + test::node_list(others) + job + " --checkpoint-dir " + dir + " --resume");
  INFO(r.out);
  CHECK(r.status == 2);
  CHECK(r.out.find("the checkpoint " + dir + "/ckpt-2-0.safetensors was made on other training data: 1024 samples as this job's, but not the same") != std::string::npos);
  for (auto& d : others) d->stop(SIGTERM);
  for (auto& d : first) d->stop(SIGTERM);
}

// The benchmarks end to end: allreduce_bench's output format, its correctness count, its flag errors;
// latency_probe's rows; train_bench's and layer_bench's rows and flag errors.
#include <catch2/catch.hpp>
#include <cctype>
#include <sstream>
#include <string>
#include <vector>

#include "tests/test_util.hpp"

namespace {

using ringmaster::test::run_result;

// `timeout` bounds the run even if the benchmark itself misbehaved.
run_result run_bench(const std::string& args) {
  return ringmaster::test::run("timeout 120 " + std::string(RINGMASTER_ALLREDUCE_BENCH_BIN) + " " + args);
}

struct row {
  size_t bytes;
  double us, algbw, busbw;
  long wrong;
};

std::vector<row> rows_of(const std::string& out) {
  std::vector<row> rows;
  std::istringstream in(out);
  std::string line;
  while (std::getline(in, line)) {
    // Ours: the rows that start with a number (the baselines' start with their name).
    if (line.find_first_not_of(' ') == std::string::npos || !std::isdigit(static_cast<unsigned char>(line[line.find_first_not_of(' ')])))
      continue;
    std::istringstream l(line);
    row r{};
    REQUIRE((l >> r.bytes >> r.us >> r.algbw >> r.busbw >> r.wrong));
    rows.push_back(r);
  }
  return rows;
}

struct floor_row {
  size_t bytes;
  double floor_us, ours_us, ratio;
};

// The --compare floor table's rows ("floor BYTES FLOOR_US OURS_US FLOOR/OURS").
std::vector<floor_row> floor_rows_of(const std::string& out) {
  std::vector<floor_row> rows;
  std::istringstream in(out);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("floor ", 0) != 0) continue;
    std::istringstream l(line.substr(6));
    floor_row r{};
    REQUIRE((l >> r.bytes >> r.floor_us >> r.ours_us >> r.ratio));
    rows.push_back(r);
  }
  return rows;
}

}  // namespace

TEST_CASE("allreduce_bench: every transport prints one correct row per size", "[bench]") {
  // tcp: sealed by default, as nodes train; plain (--security none) as Gloo and MPI run; ipc over CurveZMQ.
  for (const std::string args : {"--ranks 2 --transport tcp", "--ranks 2 --transport tcp --security none",
                                 "--ranks 3 --transport ipc --small 0", "--ranks 2 --transport inproc",
                                 "--ranks 3 --transport shm --security none", "--ranks 2 --transport shm --security none --lend off"}) {
    const run_result r = run_bench(args + " --sizes 4K,256K,1M --iters 3 --warmup 1");
    INFO(args << "\n" << r.out);
    REQUIRE(r.status == 0);
    CHECK(r.out.rfind("# allreduce_bench: ", 0) == 0);
    if (args.find("tcp") != std::string::npos)
      CHECK(r.out.find(args.find("none") != std::string::npos ? "security none" : "security sealed") != std::string::npos);
    if (args.find("ipc") != std::string::npos) CHECK(r.out.find("security curve") != std::string::npos);
    if (args.find("shm") != std::string::npos)
      CHECK(r.out.find(args.find("--lend off") != std::string::npos ? "shared memory, copied" : "shared memory, lent buffers") != std::string::npos);
    CHECK(r.out.find("# memcpy 64 MiB") != std::string::npos);
    const auto rows = rows_of(r.out);
    REQUIRE(rows.size() == 3);
    CHECK(rows[0].bytes == 4096);
    CHECK(rows[1].bytes == 256 * 1024);
    CHECK(rows[2].bytes == 1024 * 1024);
    for (const auto& w : rows) {
      CHECK(w.wrong == 0);
      CHECK(w.us > 0);
      // algbw = bytes / time, both rounded in print (a loaded machine can print 0.000 GB/s for 4 KB).
      CHECK(w.algbw == Approx(double(w.bytes) / w.us / 1e3).epsilon(0.01).margin(0.0011));
    }
    // busbw = algbw * 2(N-1)/N: equal for 2 ranks, 4/3 of it for 3.
    const double n = args.find("--ranks 3") != std::string::npos ? 3 : 2;
    CHECK(rows[2].busbw == Approx(rows[2].algbw * 2 * (n - 1) / n).epsilon(0.01));
    // Over tcp the bare-TCP floor follows by default, a row per size against ours; elsewhere none.
    const auto floors = floor_rows_of(r.out);
    if (args.find("tcp") == std::string::npos) {
      CHECK(floors.empty());
      continue;
    }
    REQUIRE(floors.size() == rows.size());
    for (size_t i = 0; i < rows.size(); ++i) {
      CHECK(floors[i].bytes == rows[i].bytes);
      CHECK(floors[i].ours_us == Approx(rows[i].us).epsilon(0.001));
      CHECK(floors[i].floor_us > 0);
      CHECK(floors[i].ratio == Approx(floors[i].floor_us / floors[i].ours_us).epsilon(0.01).margin(0.006));
    }
  }
}

TEST_CASE("allreduce_bench --compare: the floor's ring over bare TCP with 3 ranks, and none", "[bench]") {
  const run_result three = run_bench("--ranks 3 --transport tcp --security none --sizes 12K,3M --iters 3 --warmup 1 --compare floor");
  INFO(three.out);
  REQUIRE(three.status == 0);
  CHECK(three.out.find("# floor: the ring's 4 steps over bare loopback TCP, 3 ranks") != std::string::npos);
  const auto floors = floor_rows_of(three.out);
  REQUIRE(floors.size() == 2);
  CHECK(floors[0].bytes == 12 * 1024);
  CHECK(floors[1].bytes == 3 * 1024 * 1024);
  // 3 MB is 4 steps of 1 MB each way per rank: not done in less than the time a copy of that takes.
  CHECK(floors[1].floor_us > floors[0].floor_us);
  const run_result none = run_bench("--ranks 2 --transport tcp --security none --sizes 4K --iters 2 --warmup 1 --compare none");
  INFO(none.out);
  REQUIRE(none.status == 0);
  CHECK(rows_of(none.out).size() == 1);
  CHECK(floor_rows_of(none.out).empty());
  CHECK(none.out.find("# floor") == std::string::npos);
  // One rank has no ring to measure: no floor by default, and no failure for it.
  const run_result one = run_bench("--ranks 1 --transport tcp --security none --sizes 4K --iters 2 --warmup 1");
  INFO(one.out);
  CHECK(one.status == 0);
  CHECK(rows_of(one.out).size() == 1);
  CHECK(floor_rows_of(one.out).empty());
}

TEST_CASE("allreduce_bench: bad flags exit 2 with a clear message", "[bench]") {
  const std::vector<std::pair<std::string, std::string>> cases{
      {"--transport carrier-pigeon", "bad value for --transport: 'carrier-pigeon' (inproc, ipc, tcp or shm)"},
      {"--transport shm --lend maybe", "bad value for --lend: 'maybe' (on or off)"},
      {"--transport shm --security sealed", "--transport shm: chunks stay on this host and are not sealed"},
      {"--sizes 4K,3", "'3' is not a byte count divisible by 4"},
      {"--sizes 1X", "'1X' is not a byte count divisible by 4"},
      // 1 TiB on 2 ranks: once std::bad_alloc (rc 134) or the OOM killer, after the small sizes ran.
      {"--sizes 4K,1024G", "--sizes: 1099511627776 bytes on 2 ranks needs about 4096.0 GiB of memory, more than "},
      {"--ranks 0", "bad value for --ranks: '0' (1-64)"},
      {"--iters", "--iters needs a value"},
      {"--frobnicate 1", "unknown flag --frobnicate"},
      {"--frobnicate", "unknown flag --frobnicate"},
      {"stray", "unexpected argument stray"},
      {"--worker-rank 0", "a worker needs --endpoints with one endpoint per rank"},
      {"--security tls", "bad value for --security: 'tls' (sealed, curve or none)"},
      {"--transport ipc --security sealed", "--security sealed needs --transport tcp"},
      {"--transport tcp --segment 8M", "--segment and --small are at most 4M"},
      {"--compare mpi", "bad value for --compare: 'mpi' (floor, gloo or none)"},
      {"--transport shm --compare floor", "--compare floor: with --transport tcp and 2 ranks or more"},
      {"--ranks 1 --compare floor", "--compare floor: with --transport tcp and 2 ranks or more"},
      {"--transport inproc --compare gloo", "--compare gloo: with --transport ipc, tcp or shm"},
  };
  for (const auto& [args, want] : cases) {
    const run_result r = run_bench(args);
    INFO(args << "\n" << r.out);
    CHECK(r.status == 2);
    CHECK(r.out.find(want) != std::string::npos);
    CHECK(r.out.find("usage: allreduce_bench") != std::string::npos);
  }
  const run_result help = run_bench("--help");
  CHECK(help.status == 0);
  CHECK(help.out.find("busbw_GBps") != std::string::npos);
}

TEST_CASE("allreduce_bench --compare gloo: Gloo's ring on the same sizes, or a clear error without PyTorch", "[bench]") {
  const run_result r = run_bench("--ranks 2 --transport tcp --security none --sizes 4K,256K --iters 3 --warmup 1 --compare gloo");
  INFO(r.out);
  REQUIRE(rows_of(r.out.substr(0, r.out.find("# gloo"))).size() == 2);  // ours first, whatever follows
  if (r.out.find("no python3 here imports torch.distributed") != std::string::npos) {  // where python3-torch is not installed
    CHECK(r.status == 1);
    CHECK(r.out.find("--compare gloo: Gloo's run gave 0 rows of 2") != std::string::npos);
    return;
  }
  REQUIRE(r.status == 0);
  std::istringstream in(r.out.substr(r.out.find("# gloo")));
  std::string line;
  std::vector<size_t> sizes;
  while (std::getline(in, line)) {
    if (line.rfind("gloo ", 0) != 0) continue;
    std::istringstream l(line.substr(5));
    size_t bytes = 0;
    double gloo_us = 0, ours_us = 0;
    std::string speedup;
    REQUIRE((l >> bytes >> gloo_us >> ours_us >> speedup));
    CHECK(gloo_us > 0);
    CHECK(ours_us > 0);
    CHECK(speedup.back() == 'x');
    CHECK(std::stod(speedup) == Approx(gloo_us / ours_us).epsilon(0.01).margin(0.011));
    sizes.push_back(bytes);
  }
  CHECK(sizes == std::vector<size_t>{4096, 256 * 1024});
}

TEST_CASE("latency_probe: one row per transport with its ratio to blocking TCP, and clear flag errors", "[bench]") {
  const auto probe = [](const std::string& args) {
    return ringmaster::test::run("timeout 120 " + std::string(RINGMASTER_LATENCY_PROBE_BIN) + " " + args);
  };
  // 6: not floats, so no bridge row; 1 MiB: the last answer, large, must reach the client before the
  // server closes its sockets
  for (const std::string bytes : {"4096", "6", "1048576"}) {
    const run_result r = probe("--iters 50 --rounds 2 --bytes " + bytes);
    INFO(r.out);
    REQUIRE(r.status == 0);
    std::istringstream in(r.out);
    std::string line;
    std::vector<std::string> names;
    double block_rt = 0;
    while (std::getline(in, line)) {
      if (line.empty() || line[0] == '#') continue;
      std::istringstream l(line);
      std::string name;
      double one_way = 0, rt = 0, ratio = 0, round1 = 0, round2 = 0;
      REQUIRE((l >> name >> one_way >> rt >> ratio >> round1 >> round2));
      CHECK(one_way > 0);
      CHECK(one_way == Approx(rt / 2).margin(0.06));
      if (name == "tcp-block") block_rt = rt;
      if (block_rt > 0) CHECK(ratio == Approx(rt / block_rt).epsilon(0.01).margin(0.006));
      names.push_back(name);
    }
    if (bytes == "6") CHECK(names == std::vector<std::string>{"tcp-spin", "tcp-block", "zeromq"});
    else CHECK(names == std::vector<std::string>{"tcp-spin", "tcp-block", "zeromq", "bridge"});
  }
  for (const auto& [args, want] : std::vector<std::pair<std::string, std::string>>{
           {"--bytes 0", "bad value for --bytes: '0' (1-1048576)"},
           {"--iters 1x", "bad value for --iters: '1x' (1-1000000)"},
           {"--pin maybe", "bad value for --pin: 'maybe' (on or off)"},
           {"--rounds", "--rounds needs a value"},
           {"stray", "unexpected argument stray"}}) {
    const run_result r = probe(args);
    INFO(args << "\n" << r.out);
    CHECK(r.status == 2);
    CHECK(r.out.find(want) != std::string::npos);
    CHECK(r.out.find("usage: latency_probe") != std::string::npos);
  }
  const run_result help = probe("--help");
  CHECK(help.status == 0);
  CHECK(help.out.find("tcp-spin") != std::string::npos);
}

TEST_CASE("train_bench and layer_bench: a short run prints its row, and bad flags exit 2 with a clear message", "[bench]") {
  const std::string train = "timeout 120 " + std::string(RINGMASTER_TRAIN_BENCH_BIN);
  const std::string layer = "timeout 120 " + std::string(RINGMASTER_LAYER_BENCH_BIN);
  for (const std::string spin : {"", " --ring-poll-us 300"}) {  // the default, and the in-process spin on
    run_result t = ringmaster::test::run(train + " --models 784-16-10 --replicas 2 --batch 8 --steps 20 --repeat 1" + spin);
    INFO(t.out);
    CHECK(t.status == 0);
    CHECK(t.out.find("\n  784-16-10 ") != std::string::npos);
  }
  run_result l = ringmaster::test::run(layer + " --model 784-16-10 --batch 8 --iters 2 --repeat 1");
  INFO(l.out);
  CHECK(l.status == 0);
  CHECK(l.out.find("forward_backward+adam") != std::string::npos);
  const std::vector<std::pair<std::string, std::string>> bad = {
      // atoi read these as 0 or 12, and --nodes 0 ran the local mode.
      {train + " --batch abc", "--batch wants a whole number in 1-65536, not 'abc'"},
      {train + " --batch 12abc", "--batch wants a whole number in 1-65536, not '12abc'"},
      {train + " --steps 0", "--steps wants a whole number in 1-100000000, not '0'"},
      {train + " --nodes 0", "--nodes wants a whole number in 2-64, not '0'"},
      {train + " --ring-poll-us -1", "--ring-poll-us wants a whole number in 0-1000000, not '-1'"},
      {train + " --data /tmp", "--node-bin and --data go with --nodes N"},
      // A Python that cannot run printed 0 as PyTorch's figure.
      {train + " --torch --python /nonexistent", "--torch: /nonexistent cannot import torch"},
      // Buffers too large for memory aborted with bad_alloc (exit 1 now, with a word).
      {"ulimit -v 2000000 && " + train + " --models 784-10 --batch 65536 --replicas 256 --steps 1 --repeat 1",
       "out of memory: try a smaller --batch"},
      {layer + " --batch abc", "--batch wants a whole number in 1-65536, not 'abc'"},
      {layer + " --iters 0", "--iters wants a whole number in 1-1000000, not '0'"},
      // Each was taken without a word: 1,28 as 1,28,1, --python without --torch ignored, a typo as --help.
      {train + " --input 1,28", "--input wants C,H,W (e.g. 1,28,28), not '1,28'"},
      {train + " --python python3", "--python names the interpreter for --torch; add --torch"},
      {layer + " --bogus", "layer_bench: unknown flag --bogus (try --help)"},
  };
  for (const auto& [cmd, says] : bad) {
    run_result r = ringmaster::test::run(cmd);
    INFO(cmd << "\n" << r.out);
    CHECK(r.status == (says.rfind("out of memory", 0) == 0 ? 1 : 2));
    CHECK(r.out.find(says) != std::string::npos);
  }
}

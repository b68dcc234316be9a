// Helpers of the elastic tests (test_elastic.cpp: nodes lost; test_rejoin.cpp: nodes taken back): node
// daemons as real processes on 127.0.0.1, jobs on them, and signals sent to one mid-epoch.
#pragma once
#include <signal.h>

#include <catch2/catch.hpp>
#include <atomic>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <thread>

#include <nlohmann/json.hpp>

#include "actors/remote_job.hpp"
#include "net/seal.hpp"
#include "tests/test_util.hpp"

namespace ringmaster::elastic_test {

using namespace std::chrono_literals;
using clock_type = std::chrono::steady_clock;

inline test::daemons start_nodes(int n, const std::string& devices = "cpu:2") {
  return test::start_daemons(n, {RINGMASTER_NODE_BIN}, devices, RINGMASTER_DATA_DIR);
}

// n daemons (one CPU replica each); node `odd` started with `flags` too (a testing flag of ringmaster-node:
// a hung rank, a node that lies).
inline test::daemons start_nodes_one_odd(int n, size_t odd, const std::vector<std::string>& flags) {
  test::daemons nodes;
  for (int i = 0; i < n; ++i) {
    std::vector<std::string> argv{RINGMASTER_NODE_BIN};
    if (size_t(i) == odd) argv.insert(argv.end(), flags.begin(), flags.end());
    nodes.push_back(std::make_unique<test::daemon_process>(argv, test::free_endpoint(), "cpu:1", RINGMASTER_DATA_DIR));
  }
  std::this_thread::sleep_for(300ms);
  return nodes;
}

// Node `hung`'s replicas stop after `steps` steps while it answers.
inline test::daemons start_nodes_one_hung(int n, size_t hung, int steps) {
  return start_nodes_one_odd(n, hung, {"--stall-after-steps", std::to_string(steps)});
}

inline train_config small_job(int64_t epochs) {
  train_config c;
  c.model = "784-64-10";
  c.global_batch = 60;
  c.epochs = epochs;
  return c;
}

// A job a signal stops: small_job(3) with checkpoints in `dir`, `signal` its interrupt flag (the caller
// sets it); *go turns true once the progress shown says `done` steps of the job are (it comes at most 10
// times a second, and at each epoch's end).
inline train_config stoppable_job(const std::string& dir, std::atomic<int>* signal, std::atomic<bool>* go, int64_t done) {
  train_config c = small_job(3);
  c.checkpoint_dir = dir;
  c.interrupt = signal;
  c.on_progress = [go, done](const progress& p) {
    if (p.epoch * p.steps + p.step >= done) *go = true;
  };
  return c;
}

// A job stopped by SIGTERM some 20 steps in, far from its end and before any checkpoint is due: the
// stop's state is the first checkpoint written in `dir`.
inline train_result stop_early(const std::string& dir, const remote_options& ro) {
  std::atomic<int> signal{0};
  std::atomic<bool> go{false};
  train_config c = stoppable_job(dir, &signal, &go, 20);
  c.epochs = 100;
  c.checkpoint_every = 1000000;
  std::thread stopper([&] {
    for (int i = 0; i < 6000 && !go; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    signal = SIGTERM;
  });
  train_result r = train_remote(c, ro);
  stopper.join();
  return r;
}

// The lines a job says (remote_options::on_event, on the launcher's thread), for the test to read.
struct event_log {
  std::mutex mu;
  std::vector<std::string> lines;
  void add(const std::string& line) {
    std::lock_guard<std::mutex> lock(mu);
    lines.push_back(line);
  }
  std::function<void(const std::string&)> hook() {
    return [this](const std::string& line) { add(line); };
  }
  size_t count(const std::string& line) {  // lines equal to it
    std::lock_guard<std::mutex> lock(mu);
    return size_t(std::count(lines.begin(), lines.end(), line));
  }
  bool said(const std::string& part) {  // in any line
    std::lock_guard<std::mutex> lock(mu);
    return std::any_of(lines.begin(), lines.end(), [&](const std::string& e) { return e.find(part) != std::string::npos; });
  }
  std::string all() {
    std::lock_guard<std::mutex> lock(mu);
    std::string text;
    for (const std::string& line : lines) text += line + "\n";
    return text;
  }
};

// `ro` over `nodes`, on 3000 training and 300 test samples.
inline remote_options on_small_data(const test::daemons& nodes, remote_options ro = {}) {
  ro.nodes = test::endpoints(nodes);
  ro.limit_train = 3000;
  ro.limit_test = 300;
  return ro;
}

// The hung-rank tests' run: small_job(epochs) on 3000 samples over `nodes`, a ring timeout of 1 s; *took:
// its seconds.
inline train_result run_with_hung_rank(const test::daemons& nodes, remote_options ro, int64_t epochs, double* took) {
  ro = on_small_data(nodes, std::move(ro));
  train_config c = small_job(epochs);
  c.ring_timeout = 1000ms;
  const auto t0 = clock_type::now();
  train_result r = train_remote(c, ro);
  *took = std::chrono::duration<double>(clock_type::now() - t0).count();
  return r;
}

// Rejoining tests: long enough for a node to be named lost, come back, load its data and join 3 s of steps
// ahead, on a faster machine too; a model whose step is mostly compute, so its pace is steady. Here (2
// cores, 3 nodes, 0.45 s an epoch alone, slower beside another suite) a node killed in the first epoch
// rejoins at epoch 12 or sooner, so 60 epochs leave room for a machine 3x as fast. (784-256-10 ran half as
// long once the backward pass got 2x faster, and 40 epochs of 784-512-10 on a quiet machine: a join found
// no epoch's end 3 s ahead.) Each epoch is time the suite waits, the join long done.
constexpr int64_t kRejoinEpochs = 60;
// How often `part` occurs in `text`, not overlapping (a line the launcher must say once).
inline size_t occurrences(const std::string& text, const std::string& part) {
  size_t n = 0;
  for (size_t at = text.find(part); at != std::string::npos; at = text.find(part, at + part.size())) ++n;
  return n;
}

inline train_config rejoin_job() {
  train_config c = small_job(kRejoinEpochs);
  c.model = "784-512-10";
  return c;
}
inline remote_options rejoin_options(const test::daemons& nodes) {
  remote_options ro;
  ro.nodes = test::endpoints(nodes);
  ro.limit_train = 6000;
  ro.limit_test = 500;
  // The default: a started daemon reads its data first, which took 4-6 s while ctest ran other jobs beside
  // (with 1.5 s the first try came late, the next one's longer lead fell past the job's end, and no join).
  ro.rejoin_lead = std::chrono::milliseconds(3000);
  return ro;
}

// A rejoining test's job: node `victim` is killed once `after` steps of the first epoch are done and
// started again (same endpoint, same key) once the launcher has named it lost; once the launcher says
// it is back (an event with its endpoint and then `back`), `when_back` runs (if given). The launcher's
// events are kept.
struct rejoin_run {
  event_log events;
  std::vector<std::string> argv{RINGMASTER_NODE_BIN};  // the victim's, when started again
  std::string log;                                     // and where its output goes ("": the test's)
  std::string back = " is back; it rejoins";

  std::string all_events() { return events.all(); }
  bool said(const std::string& part) { return events.said(part); }

  train_result run(train_config c, remote_options ro, test::daemons& nodes, size_t victim, int64_t after,
                   const std::function<void()>& when_back = nullptr) {
    const std::string who = nodes[victim]->endpoint;
    std::atomic<bool> go{false}, lost{false}, back{false}, over{false};
    ro.on_event = [&](const std::string& line) {
      events.add(line);
      if (line.rfind("lost node " + who, 0) == 0) lost = true;
      if (line.find(who + this->back) != std::string::npos) back = true;
    };
    c.on_progress = [&](const progress& p) {
      if (p.epoch == 0 && p.step >= after) go = true;
    };
    auto wait = [&over](std::atomic<bool>& flag) {  // false once the job is over, or after a minute
      for (int i = 0; i < 6000 && !flag && !over; ++i) std::this_thread::sleep_for(10ms);
      return flag.load();
    };
    std::thread chaos([&] {
      if (!wait(go)) return;
      nodes[victim]->stop(SIGKILL);
      if (!wait(lost)) return;
      nodes[victim] = std::make_unique<test::daemon_process>(argv, who, "cpu:1", RINGMASTER_DATA_DIR, log);
      if (when_back && wait(back)) when_back();
    });
    train_result r = train_remote(c, ro);
    over = true;
    chaos.join();
    return r;
  }
};

// The launcher's events of a job in which node `victim` is stopped (SIGSTOP): kept, and the node woken
// (SIGCONT) once the launcher names it lost; `also` sees every line too.
struct stop_wake_events {
  event_log log;
  std::atomic<bool> lost{false};

  bool said(const std::string& part) { return log.said(part); }
  std::function<void(const std::string&)> hook(test::daemons& nodes, size_t victim,
                                               std::function<void(const std::string&)> also = nullptr) {
    return [this, &nodes, victim, also](const std::string& line) {
      log.add(line);
      if (line.rfind("lost node", 0) == 0 && !lost.exchange(true)) kill(nodes[victim]->pid, SIGCONT);
      if (also) also(line);
    };
  }
};

// Runs `cfg` on the nodes, signalling node `victim` with `sig` once `after` steps of epoch `epoch` are
// done; *at is when.
inline train_result run_killing(train_config cfg, const remote_options& ro, test::daemons& nodes, size_t victim, int sig,
                         int64_t epoch, int64_t after, clock_type::time_point* at) {
  std::atomic<bool> go{false};
  cfg.on_progress = [&](const progress& p) {
    if (p.epoch == epoch && p.step >= after) go = true;
  };
  std::thread killer([&] {
    for (int i = 0; i < 6000 && !go; ++i) std::this_thread::sleep_for(10ms);
    *at = clock_type::now();
    if (sig == SIGKILL) nodes[victim]->stop(SIGKILL);
    else kill(nodes[victim]->pid, sig);
  });
  train_result r = train_remote(cfg, ro);
  killer.join();
  return r;
}



// The launcher with `args`, its output read line by line; `on_line` sees each as it comes.
inline test::run_result run_launcher(const std::string& args, const std::function<void(const std::string&)>& on_line) {
  FILE* p = popen((std::string(RINGMASTER_MNIST_BIN) + " " + args + " 2>&1").c_str(), "r");
  REQUIRE(p);
  std::string out;
  char line[4096];
  while (std::fgets(line, sizeof line, p)) {
    out += line;
    on_line(line);
  }
  const int st = pclose(p);
  return {WIFEXITED(st) ? WEXITSTATUS(st) : -1, out};
}

inline nlohmann::json report(const std::string& path) {
  nlohmann::json j = nlohmann::json::parse(test::slurp(path), nullptr, false);
  REQUIRE(j.is_object());
  return j;
}

// The launcher with `args` on `nodes`: node 1 is killed as the first epoch starts, and started again on
// its endpoint, reading `data`, once the launcher has named it lost.
inline test::run_result run_restarting_node_1(test::daemons& nodes, const std::string& args, const std::string& data) {
  std::thread killer, starter;
  test::run_result r = run_launcher("--nodes " + test::node_list(nodes) + " " + args, [&](const std::string& line) {
    if (line.find("Epoch 1/") != std::string::npos && !killer.joinable()) killer = std::thread([&] { nodes[1]->stop(SIGKILL); });
    if (line.find("lost node " + nodes[1]->endpoint) != std::string::npos && !starter.joinable())
      starter = std::thread([&] {
        killer.join();
        nodes[1] = std::make_unique<test::daemon_process>(std::vector<std::string>{RINGMASTER_NODE_BIN}, nodes[1]->endpoint, "cpu:1", data);
      });
  });
  if (starter.joinable()) starter.join();
  if (killer.joinable()) killer.join();
  return r;
}


// A job that went on through losses and joins: it finished, its replicas bit-identical, and every epoch
// saw each of its 6000 samples once.
inline void check_every_sample_once(const train_result& r) {
  REQUIRE(r.ok);
  CHECK(r.identical);
  for (const epoch_stats& e : r.history) CHECK(e.samples == 6000);
}

}  // namespace ringmaster::elastic_test

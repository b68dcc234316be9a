// The node daemon's command line and lifetime (see actors/node_main.hpp); tools/node.cpp is its main.
#include "actors/node_main.hpp"

#include <pthread.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>

#include <boost/program_options.hpp>
#include <algorithm>
#include <charconv>
#include <cstdio>
#include <ctime>
#include <iostream>
#include <set>
#include <string>
#include <vector>

#include "actors/node_service.hpp"
#include "kernels/backend.hpp"
#include "net/keys.hpp"

namespace po = boost::program_options;

namespace ringmaster {
namespace {

// "ringmaster-node" from "/usr/bin/ringmaster-node".
std::string program_name(int argc, char** argv) {
  std::string p = argc > 0 && argv && argv[0] ? argv[0] : "ringmaster-node";
  if (size_t slash = p.rfind('/'); slash != std::string::npos) p = p.substr(slash + 1);
  return p.empty() ? "ringmaster-node" : p;
}

// Blocks SIGINT, SIGTERM and SIGHUP (its ssh session closed; unless ignored, as under nohup) in this
// thread (and so in every thread started from here on) for as long as it lives, so that sigwait takes
// them rather than a handler on some other thread; then drops any still pending (a second Ctrl-C during
// shutdown) and restores the caller's mask.
class blocked_signals {
 public:
  blocked_signals() {
    sigemptyset(&set_);
    sigaddset(&set_, SIGINT);
    sigaddset(&set_, SIGTERM);
    // Not when the caller ignores it (nohup): blocked, it would stay pending and reach sigwait.
    struct sigaction was {};
    if (sigaction(SIGHUP, nullptr, &was) == 0 && was.sa_handler != SIG_IGN) sigaddset(&set_, SIGHUP);
    pthread_sigmask(SIG_BLOCK, &set_, &old_);
  }
  ~blocked_signals() {
    const timespec now{0, 0};
    while (sigtimedwait(&set_, nullptr, &now) > 0) {
    }
    pthread_sigmask(SIG_SETMASK, &old_, nullptr);
  }
  blocked_signals(const blocked_signals&) = delete;
  blocked_signals& operator=(const blocked_signals&) = delete;
  int wait() const {
    int sig = 0;
    while (sigwait(&set_, &sig) != 0) {
    }
    return sig;
  }
  // The next signal within `ms`, or 0.
  int wait_for(int ms) const {
    const timespec t{ms / 1000, long(ms % 1000) * 1000000L};
    const int sig = sigtimedwait(&set_, nullptr, &t);
    return sig > 0 ? sig : 0;
  }

 private:
  sigset_t set_, old_;
};

}  // namespace

int node_main(int argc, char** argv, std::shared_ptr<const layer_registry> layers) {
  const std::string prog = program_name(argc, argv);
  // First, before anything may start a thread (CUDA's driver does, asked for its devices), so that every
  // thread inherits the mask and SIGINT, SIGTERM or SIGHUP always reach the sigwait below.
  blocked_signals signals;
  // A daemon's stderr may be a pipe whose reader is gone (`| head`, a log shipper that died): a write
  // to it is an error to shrug off, not the end of the node and of its jobs (as sshd and nginx do).
  struct sigaction pipe_was {};
  if (sigaction(SIGPIPE, nullptr, &pipe_was) == 0 && pipe_was.sa_handler == SIG_DFL) ::signal(SIGPIPE, SIG_IGN);
  node_options o;
  o.layers = layers;
  int64_t poll_us = o.ring_poll.count();
  uint32_t slow_states_ms = 0;  // testing
  double launcher_timeout = o.launcher_timeout.count() / 1000.0;
  bool print_key = false;
  po::options_description desc(prog + ": serves training jobs to ringmaster launchers\n\nUsage: " + prog +
                               " --listen ENDPOINT [options]\n\nOptions");
  desc.add_options()
      ("help,h", "show this help and exit")
      ("listen", po::value(&o.listen), "where launchers and other nodes reach this node: tcp://ADDRESS:PORT (ADDRESS an IP address, * or a network interface such as eth0; PORT 0 or *: any free port) or ipc://PATH")
      ("name", po::value(&o.name), "name in logs and errors (default: the endpoint)")
      ("devices", po::value(&o.devices)->default_value(o.devices), "what this node offers, one replica per device: cpu:N (N CPU replicas), cuda (every GPU), cuda:I[,J...] (those GPUs)")
      ("data", po::value(&o.data_dir)->default_value(o.data_dir), "this node's copy of the data (IDX files)")
      ("key-dir", po::value(&o.key_dir), "this node's key, key.pub and authorized_keys (default ~/.ringmaster; made on first use)")
      ("insecure", po::bool_switch(&o.insecure), "no keys and no encryption: anyone who reaches the port can command this node")
      ("print-key", po::bool_switch(&print_key), "print this node's public key (KEY_DIR/key.pub, made on first use) for launchers' --nodes HOST:PORT@KEY, and exit")
      ("max-connections", po::value(&o.max_connections)->default_value(o.max_connections), "clients connected at once (at most what the file descriptor limit leaves room for); the first few over it are refused at the handshake, more are hung up as they connect")
      ("ring-port", po::value(&o.ring_port)->default_value(o.ring_port), "the port other nodes send ring chunks to (sealed with AES-128-OCB; plain with --insecure), on the --listen host (open it in a firewall); 0: any free port")
      ("launcher-timeout", po::value(&launcher_timeout)->default_value(launcher_timeout, "4"), "seconds a job waits for a launcher that has fallen silent (stopped, starved, cut off) before it drops the job (1-600); what the job sends meanwhile waits for it (a job that sends more than 10,000 messages meanwhile ends), and this node keeps any silent peer's connection that long")
      ("ring-poll-us", po::value(&poll_us)->default_value(poll_us), "a replica waiting for the ring takes chunks that come through shared memory or to the ring port itself, spinning, for up to N us a step, sparing thread wake-ups; 0: never");
  // For tests, not in --help: this node's replicas stop after N steps of a job (as a stuck GPU would), or
  // once told to pause for a node that rejoins, while the node goes on answering; it sends states, or
  // checksums of its ranks' states, not its ranks' own, or a paused rank's state N ms late, or a step record of a
  // ring generation to come at the job's last step; a connection to
  // its ring port is cut after N chunks.
  po::options_description testing;
  testing.add_options()
      ("stall-after-steps", po::value(&o.stall_after_steps))
      ("stall-at-join-pause", po::bool_switch(&o.stall_at_join_pause))
      ("lie-in-states", po::bool_switch(&o.lie_in_states))
      ("lie-in-sums", po::bool_switch(&o.lie_in_sums))
      ("lie-in-steps", po::bool_switch(&o.lie_in_steps))
      ("slow-states-ms", po::value(&slow_states_ms))
      ("cut-ring-link-after", po::value(&o.cut_ring_link_after))
      ("cut-every-ring-link", po::bool_switch(&o.cut_every_ring_link));
  po::options_description all;
  all.add(desc).add(testing);
  po::variables_map vm;
  try {
    po::store(po::command_line_parser(argc > 0 ? argc : 1, argv).options(all).positional(po::positional_options_description()).run(), vm);
    po::notify(vm);
  } catch (const po::error& e) {  // a stray word (no positional arguments) included: it is not ignored
    const bool stray = dynamic_cast<const po::too_many_positional_options_error*>(&e) != nullptr;
    std::fprintf(stderr, "%s: %s\nTry '%s --help'.\n", prog.c_str(),
                 stray ? "unexpected argument: every option starts with --" : e.what(), prog.c_str());
    return 2;
  }
  if (vm.count("help")) {
    std::string known;
    for (const std::string& t : (layers ? *layers : layer_registry::with_builtins()).types())
      known += (known.empty() ? "" : ", ") + t;
    std::cout << desc << "\nLayer types this node builds: " << known << "\n\nExample: " << prog
              << " --listen tcp://127.0.0.1:5601 --devices cpu:2\n\n"
              << "Links are encrypted and authenticated with CurveZMQ. The node serves launchers whose public key is\n"
                 "in KEY_DIR/authorized_keys (one per line), or that share its key directory (a shared home). Give\n"
                 "launchers this node's KEY_DIR/key.pub: ringmaster-mnist --nodes tcp://HOST:PORT@KEY records it.\n";
    return 0;
  }
  // An empty value is a mistake (an unset shell variable), not a wish for the default.
  for (const auto& [flag, value] : vm)
    if (!value.defaulted() && value.value().type() == typeid(std::string) && value.as<std::string>().empty()) {
      std::fprintf(stderr, "%s: --%s must not be empty\n", prog.c_str(), flag.c_str());
      return 2;
    }
  if (print_key) {  // before it serves: what a launcher's owner needs to know first
    net::key_pair keys;
    std::string why;
    if (o.insecure || !net::load_or_create_keys(o.key_dir.empty() ? net::default_key_dir() : o.key_dir, &keys, &why)) {
      std::fprintf(stderr, "%s: --print-key: %s\n", prog.c_str(), o.insecure ? "an --insecure node has no key" : why.c_str());
      return 2;
    }
    std::printf("%s\n", keys.public_key.c_str());
    return std::fflush(stdout) == 0 && !std::ferror(stdout) ? 0 : 1;  // a full disk or a closed pipe: no key was given
  }
  if (o.listen.empty()) {
    std::fprintf(stderr, "%s: --listen is required (e.g. tcp://127.0.0.1:5601)\n", prog.c_str());
    return 2;
  }
  std::vector<std::string> slots;
  std::string error;
  // The data are read when a job asks for them; a folder that is not there is a mistake to name now.
  if (struct stat st {}; ::stat(o.data_dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    std::fprintf(stderr, "%s: --data %s is not a folder (the IDX files of the data set)\n", prog.c_str(), o.data_dir.c_str());
    return 2;
  }
  if (!net::check_endpoint(o.listen, true, &error) || !net::check_listen_host(o.listen, &error)) {
    std::fprintf(stderr, "%s: --listen: %s\n", prog.c_str(), error.c_str());
    return 2;
  }
  if (!parse_devices(o.devices, &slots, &error)) {
    std::fprintf(stderr, "%s: %s\n", prog.c_str(), error.c_str());
    return 2;
  }
  // parse_devices takes any KIND:I (tests offer simulated devices); a daemon has CPUs and CUDA GPUs.
  for (const std::string& s : slots)
    if (const std::string kind = device_kind(s); kind != "cpu" && kind != "cuda") {
      std::fprintf(stderr, "%s: --devices %s: unknown device kind '%s': expected cpu:N (N CPU replicas), cuda (every GPU) "
                   "or cuda:I[,J...] (GPUs by number)\n", prog.c_str(), o.devices.c_str(), kind.c_str());
      return 2;
    }
  // GPUs this machine does not have are a mistake in the command line too (exit 2, as --devices cuda).
  if (std::any_of(slots.begin(), slots.end(), [](const std::string& s) { return device_kind(s) == "cuda"; })) {
    const int gpus = cuda_device_count();
    for (const std::string& s : slots) {
      int g = 0;  // parse_devices took 1-4 digits after "cuda:"
      if (device_kind(s) == "cuda" && (std::from_chars(s.data() + 5, s.data() + s.size(), g).ec != std::errc() || g >= gpus)) {
        if (gpus == 0) std::fprintf(stderr, "%s: --devices %s: this machine has no usable CUDA device\n", prog.c_str(), o.devices.c_str());
        else std::fprintf(stderr, "%s: --devices %s: there is no GPU %s here (this machine has %d: 0-%d)\n", prog.c_str(),
                          o.devices.c_str(), s.substr(5).c_str(), gpus, gpus - 1);
        return 2;
      }
    }
  }

  // The name is the routing id of our links to other nodes, which plans carry: 1..255 printable bytes.
  if (o.name.size() > 200 || std::any_of(o.name.begin(), o.name.end(), [](char c) { return c < 0x20 || c > 0x7e; })) {
    std::fprintf(stderr, "%s: --name must be at most 200 printable ASCII characters\n", prog.c_str());
    return 2;
  }
  if (poll_us < 0 || poll_us > 1000000) {
    std::fprintf(stderr, "%s: --ring-poll-us must be 0-1000000\n", prog.c_str());
    return 2;
  }
  o.ring_poll = std::chrono::microseconds(poll_us);
  o.slow_states = std::chrono::milliseconds(std::min<uint32_t>(slow_states_ms, 60000));
  if (!(launcher_timeout >= 1 && launcher_timeout <= 600)) {
    std::fprintf(stderr, "%s: --launcher-timeout must be 1-600 (seconds)\n", prog.c_str());
    return 2;
  }
  o.launcher_timeout = std::chrono::milliseconds(int64_t(launcher_timeout * 1000));
  if (o.max_connections < 1) {
    std::fprintf(stderr, "%s: --max-connections must be at least 1\n", prog.c_str());
    return 2;
  }
  if (o.insecure && !o.key_dir.empty()) {
    std::fprintf(stderr, "%s: --key-dir and --insecure: a node run --insecure uses no keys\n", prog.c_str());
    return 2;
  }
  if (o.ring_port != 0 && o.listen.rfind("tcp://", 0) != 0) {
    std::fprintf(stderr, "%s: --ring-port needs a tcp:// --listen endpoint\n", prog.c_str());
    return 2;
  }
  if (o.ring_port < 0 || o.ring_port > 65535) {
    std::fprintf(stderr, "%s: --ring-port must be a port number, 0-65535 (0: any free port)\n", prog.c_str());
    return 2;
  }
  if (o.ring_port != 0 && o.listen.substr(o.listen.rfind(':') + 1) == std::to_string(o.ring_port)) {
    std::fprintf(stderr, "%s: --ring-port %d is the --listen port: ring chunks need a port of their own\n", prog.c_str(), o.ring_port);
    return 2;
  }
  // Every connection holds a file descriptor: take all the system allows us (the soft limit is often 1024).
  rlimit files{};
  if (getrlimit(RLIMIT_NOFILE, &files) == 0 && files.rlim_cur < files.rlim_max) {
    const rlimit want{files.rlim_max, files.rlim_max};
    if (setrlimit(RLIMIT_NOFILE, &want) == 0) files = want;
  }
  // And serve no more clients at once than the limit leaves room for beside the data, segments, ring
  // links and ZeroMQ's own: a flood of connections is then hung up as it comes, rather than running us
  // out of descriptors (libzmq retries a failed accept in a busy loop, at 100% CPU, until one is free).
  if (getrlimit(RLIMIT_NOFILE, &files) == 0 && files.rlim_cur != RLIM_INFINITY) {
    const long limit = long(std::min<rlim_t>(files.rlim_cur, rlim_t(1) << 24));
    const long room = limit - std::max(64L, std::min(256L, limit / 4));  // an idle node holds some 20
    if (room < o.max_connections) {
      std::fprintf(stderr, "%s: file descriptor limit %ld (ulimit -n): serving at most %ld client%s at once, not %d\n",
                   prog.c_str(), limit, std::max(1L, room), room > 1 ? "s" : "", o.max_connections);
      o.max_connections = int(std::max(1L, room));
    }
  }

  // A key folder that will not do (a file, a secret key others may read, a damaged key or authorized_keys)
  // is a mistake in how the node is set up: named before it serves, and with the launcher's exit status.
  if (!o.insecure) {
    const std::string dir = o.key_dir.empty() ? net::default_key_dir() : o.key_dir;
    net::key_pair keys;
    std::set<std::string> authorized;
    if (!net::load_or_create_keys(dir, &keys, &error) || !net::read_authorized_keys(dir + "/authorized_keys", &authorized, &error)) {
      std::fprintf(stderr, "%s: --key-dir: %s\n", prog.c_str(), error.c_str());
      return 2;
    }
  }
  node_service node(o);
  if (!node.start(&error)) {
    std::fprintf(stderr, "%s: cannot start: %s\n", prog.c_str(), error.c_str());
    return 1;
  }
  const int sig = signals.wait();
  const char* name = sig == SIGINT ? "SIGINT" : sig == SIGHUP ? "SIGHUP" : "SIGTERM";
  // A running job's launcher may be stopping too (a batch system stops a whole allocation at once): it
  // gets a while to pause the ranks and fetch a state for its checkpoint (node_service::announce_stop).
  // Once it drops the job, the grace ends, or a second signal comes, the node stops.
  if (node.announce_stop(name, std::chrono::milliseconds(kStopGrace).count())) {
    node.log(std::string(name) + " received: the running job's launcher has up to " + std::to_string(kStopGrace.count()) +
             " s to stop it (a checkpoint where it stops); shutting down then (a second signal: at once)");
    const auto until = std::chrono::steady_clock::now() + kStopGrace;
    while (node.busy() && std::chrono::steady_clock::now() < until && !signals.wait_for(50)) {
    }
    node.log(node.busy() ? "the job's launcher did not drop it within " + std::to_string(kStopGrace.count()) + " s (or a second signal came); shutting down"
                         : "its job was dropped; shutting down");
  } else {
    node.log(std::string(name) + " received, shutting down");  // not on stderr itself: it may be stalled
  }
  node.stop(name);
  return 0;
}

}  // namespace ringmaster

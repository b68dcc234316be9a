// The launcher's waits while its nodes set a job up (actors/launcher.hpp): for an answer from every node,
// and for nodes busy with another job to be free. The caller's thread, not the bridge's.
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <thread>

#include "actors/launcher.hpp"

namespace ringmaster {

using clock_type = launcher::clock_type;

// How long a node busy with a job whose launcher still heartbeats is asked again (await_free).
constexpr std::chrono::milliseconds kLiveBusyWait{1000};
// After a node refuses, how long the others' answers are waited for, so that every node's reason is said
// at once (nodes that lack the data all lack it: the user should not learn it one node at a time).
constexpr std::chrono::milliseconds kRefusalGrace{1000};
// Refusals named in full; more are counted.
constexpr int kRefusalsNamed = 4;

std::string launcher::await_all(wire::msg_type type, std::vector<wire::kv_map>* replies, std::chrono::milliseconds limit,
                                std::chrono::milliseconds silence, std::chrono::milliseconds first_word,
                                std::optional<clock_type::time_point> since) {
  replies->assign(ro.nodes.size(), {});
  std::vector<bool> got(ro.nodes.size(), false);
  size_t n = 0;
  const auto start = since.value_or(clock_type::now()), deadline = start + limit;
  auto beat = start;
  std::string refusals;
  int refused = 0;                             // nodes that refused
  std::vector<bool> said(ro.nodes.size(), false);  // per node: its refusal is in
  std::optional<clock_type::time_point> refused_by;  // when the first refusal's grace is up
  std::unique_lock<std::mutex> lock(mu);
  while (n < ro.nodes.size() && !(refused_by && clock_type::now() > *refused_by)) {
    if (!cv.wait_for(lock, std::chrono::milliseconds(50), [this] { return !inbox.empty(); })) {
      if (const int sig = interrupted()) return interrupted_by(sig);
      const auto now = clock_type::now();
      // Heartbeats while the nodes set up, too: a node whose launcher died frees itself within seconds.
      if (job_id != 0 && now - beat >= ro.heartbeat) {
        beat = now;
        broadcast(wire::msg_type::heartbeat, {});
      }
      for (size_t i = 0; i < got.size() && !refused_by; ++i) {  // after a refusal, the others have until its grace is up
        if (got[i]) continue;
        const auto quiet = now - std::max(heard(int(i)), start);
        const auto allowed = heard(int(i)) > start ? silence : std::max(silence, first_word);
        if (now > deadline || quiet > allowed) {
          char secs[32];  // 3, 1.5, 120, 3600: not "120." nor "3.6e+03"
          std::snprintf(secs, sizeof secs, "%.6g", std::chrono::duration<double>(now > deadline ? limit : allowed).count());
          // An ipc path with no socket (ZeroMQ waits for one, so a daemon started with us may still come).
          struct stat st {};
          const std::string& ep = ro.nodes[i];
          if (ep.rfind("ipc://", 0) == 0 && ep.size() > 6 && ep[6] != '@' && ::stat(ep.c_str() + 6, &st) != 0) {
            const int why = errno;  // before the strings below allocate
            return "node " + ep + " did not answer within " + secs + " s: " +
                   (why == ENOENT ? "there is no socket at " + ep.substr(6) + " (is ringmaster-node running there?)"
                                  : "cannot reach " + ep.substr(6) + ": " + std::strerror(why));
          }
          // It answered our hello (every node did, before a job was sent): not a matter of keys or addresses.
          if (type != wire::msg_type::hello_ack) {
            if (quiet <= allowed) return "node " + ep + " did not set the job up within " + secs + " s, though it still answers";
            std::snprintf(secs, sizeof secs, "%.6g", std::chrono::duration<double>(allowed).count());
            return "node " + ep + " fell silent while it set the job up: nothing from it for " + secs +
                   " s (it had answered our hello: stopped, killed or cut off?)";
          }
          if (unreachable[i])  // the same words as below begin it: a name that does not resolve is still told apart
            return "node " + ro.nodes[i] + " did not answer within " + secs + " s: nothing accepted a connection there "
                   "(is ringmaster-node running there? a firewall in the way?)";
          return "node " + ro.nodes[i] + " did not answer within " + secs + " s (is ringmaster-node running there? " +
                 (ro.insecure ? "We run --insecure: a node with keys does not let us in)"
                              : "A node that does not hold the key we expect, or runs --insecure while we do not, stays silent)");
        }
      }
      continue;
    }
    control_msg m = std::move(inbox.front());
    inbox.pop_front();
    if (m.h.type == wire::msg_type::error) {
      // A bad model or settings: one node that says so is enough (the same job went to all of them).
      refused_invalid = refused_invalid || (m.kv.count("invalid") && m.kv["invalid"] == "1");
      if (said[m.node]) continue;
      said[m.node] = true;
      if (refused++ < kRefusalsNamed)
        refusals += (refusals.empty() ? "" : "; ") +
                    (m.kv.count("error") ? node_text(m.kv["error"], kMaxNodeError) : "node " + ro.nodes[m.node] + " refused the job");
      if (!got[m.node]) got[m.node] = true, ++n;
      if (!refused_by) refused_by = clock_type::now() + kRefusalGrace;
      continue;
    }
    if (m.h.type == wire::msg_type::abort) {  // stopped while it set up: say so, not that it fell silent
      const std::string& sig = m.kv["stopped"], &why = m.kv["reason"];
      const std::string before = refusals.empty() ? "" : refusals + "; ";  // refusals that came first are said too
      if (stopped_by_signal(sig)) return before + "node " + ro.nodes[m.node] + " was stopped (" + sig + ") while it set up the job";
      return before + "node " + ro.nodes[m.node] + " gave up the job as it set it up" + (why.empty() ? "" : ": " + node_text(why, kMaxNodeError));
    }
    if (m.h.type != type || got[m.node]) continue;
    got[m.node] = true;
    (*replies)[m.node] = std::move(m.kv);
    ++n;
  }
  if (refused > kRefusalsNamed) refusals += "; and " + std::to_string(refused - kRefusalsNamed) + " more nodes refused it";
  return refusals;
}

std::string launcher::await_free(std::vector<wire::kv_map>* hellos) {
  const auto start = clock_type::now(), deadline = start + ro.busy_wait;
  for (bool said = false;;) {
    std::string held;
    int64_t longest = 0;  // ms until the last of them is free
    bool live = false;    // a node busy with a job whose launcher still heartbeats
    for (size_t i = 0; i < hellos->size(); ++i) {
      if ((*hellos)[i]["busy"] != "1") continue;
      const std::string& t = (*hellos)[i]["free_in_ms"];
      if (t.empty()) {
        live = true;
        continue;
      }
      int64_t ms = -1;  // a node's word: checked, never std::stoll
      const auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), ms);
      if (ec != std::errc() || end != t.data() + t.size() || ms < 0 || ms > 3600000) return "";
      held += (held.empty() ? "" : ", ") + ro.nodes[i];
      longest = std::max(longest, ms);
    }
    const auto now = clock_type::now();
    // A launcher that crashed a moment ago has not been silent long enough for its nodes to say so: one
    // busy with a live launcher's job is asked again for a second, then left to refuse ours (saying why).
    // So is one that will not be free by the deadline.
    if ((live && now - start >= kLiveBusyWait) || (!live && held.empty()) || now + std::chrono::milliseconds(longest) > deadline)
      return "";
    if (!said && !live && !held.empty()) {  // every busy node known to be waiting for a silent launcher
      said = true;
      char secs[32];
      std::snprintf(secs, sizeof secs, "%.1f", double(longest) / 1000);
      event(held + (held.find(',') == std::string::npos ? " holds" : " hold") +
            " a job whose launcher fell silent (crashed?), dropped within " + secs + " s: waiting for it");
    }
    for (int k = 0; k < 5; ++k) {  // 250 ms, a Ctrl-C heard meanwhile
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      if (const int sig = interrupted()) return interrupted_by(sig);
    }
    broadcast(wire::msg_type::hello, {{"role", "launcher"}});
    if (std::string error = await_all(wire::msg_type::hello_ack, hellos, ro.connect_timeout, ro.connect_timeout); !error.empty())
      return error;
  }
}

}  // namespace ringmaster

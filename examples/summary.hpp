// A launcher's summary of what happened to nodes on the way: lost, taken back, tried and refused, ring
// links broken between them, found faulty as the job ended; all but the last in the order they happened (a node lost, back, refused, lost
// again and taken back reads as it went).
#pragma once
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "actors/coordinator.hpp"

namespace ringmaster::examples {

// printf into a string, whatever its length (a node's words in `why` may be long).
inline std::string printed(const char* format, ...) __attribute__((format(printf, 1, 2)));
inline std::string printed(const char* format, ...) {
  va_list args, again;
  va_start(args, format);
  va_copy(again, args);
  const int n = std::vsnprintf(nullptr, 0, format, args);
  va_end(args);
  std::string out(n > 0 ? size_t(n) : 0, '\0');
  if (n > 0) std::vsnprintf(out.data(), out.size() + 1, format, again);
  va_end(again);
  return out;
}

// The summary's lines about nodes. stopped: a signal ended the job (one lost meanwhile had no ring
// re-formed without it).
inline std::vector<std::string> node_summary(const train_result& r, bool stopped) {
  std::vector<std::pair<std::chrono::steady_clock::time_point, std::string>> said;
  for (const node_loss& l : r.losses) {
    const char* since = l.hung ? "the ring's last step" : "its last message";
    std::string line = printed("Lost node %s (%s): %s, named %.2f s after %s; %d rank%s %s epoch %lld, step %lld", l.node.c_str(),
                               ranks_named(l.ranks).c_str(), l.why.c_str(), l.detected, since, l.survivors, l.survivors == 1 ? "" : "s",
                               !std::isnan(l.recovered) ? "went on from"
                               : stopped               ? "left as the job stopped, in"
                                                       : "left with no step to run after its last,",
                               (long long)l.epoch + 1, (long long)l.step + 1);
    if (!std::isnan(l.recovered)) line += printed("; the next step was complete %.2f s after %s", l.recovered, since);
    said.emplace_back(l.when, std::move(line));
  }
  for (const node_join& j : r.joins)
    said.emplace_back(j.when, printed("Node %s came back and rejoined as %s: %d ranks went on from epoch %lld (the others stood still for %.2f s)",
                                      j.node.c_str(), ranks_named(j.ranks).c_str(), j.replicas, (long long)j.epoch + 1, j.paused));
  for (const failed_join& f : r.failed_joins)
    said.emplace_back(f.when, printed("Node %s came back, but a try to rejoin failed: %s (%s)", f.node.c_str(), f.why.c_str(),
                                      f.asked_again ? "it was to be asked again" : "it stayed out"));
  // (Where no node was lost or taken back the weights are an undisturbed run's; else the line below says so.)
  const bool same_ranks = r.losses.empty() && r.joins.empty();
  const char* same = same_ranks ? ", which sum as before (the weights are an uninterrupted run's)" : "";
  for (const ring_relink& b : r.relinks)
    said.emplace_back(b.when, b.from.empty()
                                  ? printed("The ring stalled in epoch %lld, step %lld with every rank waiting for another while every node "
                                            "still answered (%s): the ring was re-formed with the same nodes%s",
                                            (long long)b.epoch + 1, (long long)b.step + 1, b.why.c_str(), same)
                                  : printed("The ring's link from node %s to node %s broke in epoch %lld, step %lld while both nodes still "
                                            "answered (the receiver saw: %s): the ring was re-formed with the same nodes%s",
                                            b.from.c_str(), b.to.c_str(), (long long)b.epoch + 1, (long long)b.step + 1, b.why.c_str(), same));
  std::stable_sort(said.begin(), said.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<std::string> lines;
  for (auto& [when, line] : said) lines.push_back(std::move(line));
  // Each gradient is summed over other ranks in another order then: last bits differ, and training grows them.
  const bool went_on = std::any_of(r.losses.begin(), r.losses.end(), [](const node_loss& l) { return !std::isnan(l.recovered); });
  if (!stopped && (went_on || !r.joins.empty()))  // (not for a node lost after the last step)
    lines.push_back("The ranks changed on the way: the weights equal an uninterrupted run's only up to rounding, which training "
                    "can grow (compare test accuracy, not weights)");
  for (const node_fault& f : r.faults)
    lines.push_back(printed("Faulty node %s (%s): %s; found as the job ended, it finished with the others", f.node.c_str(),
                            ranks_named(f.ranks).c_str(), f.why.c_str()));
  if (r.unmeasured)
    lines.push_back(printed("%lld training samples count without their loss and accuracy (reports lost with a node, or of a step a rank "
                            "had not finished when the ring was re-formed: it took the state after it from another)",
                            (long long)r.unmeasured));
  if (r.partial_evals)
    lines.push_back(printed("%lld epochs' test loss and accuracy cover only the survivors' shares of the test set (a lost node's share "
                            "of their evaluation went with it)",
                            (long long)r.partial_evals));
  return lines;
}

}  // namespace ringmaster::examples

// judge_states (actors/state_verdict.hpp).
#include "actors/state_verdict.hpp"

#include <algorithm>
#include <map>
#include <set>

namespace ringmaster {

namespace {

// "node A and node B". Only a majority of two nodes or more names anyone: the verb after it is plural.
std::string listed(const std::vector<std::string>& names) {
  std::string out;
  for (size_t i = 0; i < names.size(); ++i) out += (i == 0 ? "" : i + 1 == names.size() ? " and " : ", ") + names[i];
  return out;
}

}  // namespace

state_verdict judge_states(std::vector<state_vote> votes, const std::string& sender, uint64_t sent, int64_t done, int sent_rank) {
  state_verdict v;
  std::sort(votes.begin(), votes.end(), [](const state_vote& a, const state_vote& b) { return a.rank < b.rank; });
  int n = 0;
  for (const state_vote& x : votes)
    if (x.sum != sent) v.disagree += (n++ ? ", " : "") + std::to_string(x.rank) + (x.where.empty() ? "" : " (" + x.where + ")");
  if (n == 0) return v;
  v.agree = false;
  v.disagree = (n == 1 ? "rank " : "ranks ") + v.disagree;
  // Nodes are told apart by where they run: without that, nobody can be named.
  if (sender.empty() || std::any_of(votes.begin(), votes.end(), [](const state_vote& x) { return x.where.empty(); })) {
    v.decided = false;
    return v;
  }
  std::vector<std::pair<std::string, std::set<uint64_t>>> held;  // node -> its ranks' checksums, in rank order
  for (const state_vote& x : votes) {
    auto node = std::find_if(held.begin(), held.end(), [&](const auto& h) { return h.first == x.where; });
    if (node == held.end()) node = held.insert(held.end(), {x.where, {}});
    node->second.insert(x.sum);
  }
  const std::string after = " after step " + std::to_string(done);
  const std::string what = "it sent rank " + std::to_string(sent_rank) + "'s state" + after;
  const std::string not_held = what + ", which its own ranks do not hold";
  std::map<uint64_t, std::vector<std::string>> says;  // checksum -> the nodes all of whose ranks hold it (rank order)
  size_t voters = 0;
  for (const auto& [node, sums] : held) {
    if (sums.size() > 1)
      v.faulty.emplace_back(node, "its ranks hold different states" + after);
    else if (node == sender && *sums.begin() != sent)
      v.faulty.emplace_back(node, not_held);
    else
      says[*sums.begin()].push_back(node), ++voters;
  }
  auto most = std::max_element(says.begin(), says.end(), [](const auto& a, const auto& b) { return a.second.size() < b.second.size(); });
  if (most == says.end() || 2 * most->second.size() <= voters) {
    v.decided = false;
    return v;
  }
  for (const auto& [sum, nodes] : says)
    for (const std::string& node : nodes)
      if (sum != most->first) v.faulty.emplace_back(node, "its ranks hold another state" + after + " than " + listed(most->second) + " hold");
  v.sender_ok = most->first == sent;
  // A sender none of whose ranks voted (lost since) is faulty all the same if a majority of two or more
  // holds another: one witness alone does not bar a node.
  if (!v.sender_ok && voters >= 2 && std::none_of(held.begin(), held.end(), [&](const auto& h) { return h.first == sender; }))
    v.faulty.emplace_back(sender, what + ", which " + listed(most->second) + " do not hold");
  return v;
}

std::string faults_named(const state_verdict& v) {
  std::string named;
  for (const auto& [where, why] : v.faulty) named += (named.empty() ? ": " : "; ") + where + ", " + why;
  return named;
}

}  // namespace ringmaster

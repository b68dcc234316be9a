#include "actors/reform.hpp"

namespace ringmaster {

bool make_reform(const job_plan& current, const std::vector<bool>& lost, int generation, uint64_t ring,
                 int64_t start, job_plan* next, std::string* error) {
  std::vector<int> survivors;
  for (const rank_plan& r : current.ranks)
    if (size_t(r.node) >= lost.size() || !lost[size_t(r.node)]) survivors.push_back(r.rank);
  if (survivors.empty()) return *error = "no rank is left to continue the job", false;
  const int m = int(survivors.size()), b = current.global_batch / m, extra = current.global_batch % m;
  job_plan p = current;
  p.generation = generation;
  p.ring = ring;
  p.start_step = start;
  p.recipient = -1;
  p.ranks.clear();
  for (int i = 0, begin = 0; i < m; ++i) {
    rank_plan r = current.ranks[size_t(survivors[size_t(i)])];
    r.was = r.rank;
    r.rank = i;
    r.left = (i + m - 1) % m;
    r.right = (i + 1) % m;
    r.batch_begin = begin;
    r.batch_end = begin += b + (i < extra ? 1 : 0);
    p.ranks.push_back(std::move(r));
  }
  if (!validate(p, error)) return false;
  *next = std::move(p);
  return true;
}

std::string check_reform(const job_plan& current, const job_plan& next) {
  if (next.job_id != current.job_id) return "the re-formed plan is for job " + std::to_string(next.job_id);
  if (next.generation <= current.generation)
    return "generation " + std::to_string(next.generation) + " does not follow generation " + std::to_string(current.generation);
  if (next.ring_id() == current.ring_id()) return "the re-formed ring has the id of the ring it replaces";
  if (next.recipient != current.recipient)
    return "the re-formed plan is addressed to node " + std::to_string(next.recipient) + ", this is node " + std::to_string(current.recipient);
  // Everything but the ranks and what names the generation must be as it was.
  auto settings = [](job_plan p) {
    p.generation = 0;
    p.ring = 0;
    p.start_step = 0;
    p.ranks.clear();
    return to_json(p);
  };
  if (settings(current) != settings(next)) return "the re-formed plan changes the job's settings or nodes";
  std::vector<int> kept(current.nodes.size(), 0);
  for (const rank_plan& r : next.ranks) {
    if (r.was >= current.replicas()) return "rank " + std::to_string(r.rank) + " was rank " + std::to_string(r.was) + ", which did not exist";
    if (current.ranks[size_t(r.was)].node != r.node)
      return "rank " + std::to_string(r.rank) + " (rank " + std::to_string(r.was) + " before) moved to another node";
    ++kept[size_t(r.node)];
  }
  for (size_t i = 0; i < kept.size(); ++i) {
    const size_t had = current.ranks_on(int(i)).size();
    if (kept[i] != 0 && size_t(kept[i]) != had)
      return "node " + current.nodes[i].endpoint + " keeps " + std::to_string(kept[i]) + " of its " + std::to_string(had) + " ranks";
  }
  return "";
}

std::string rank_list(const std::vector<int>& rs) {
  bool contiguous = !rs.empty() && rs.back() - rs.front() == int(rs.size()) - 1;
  if (contiguous && rs.size() > 1) return std::to_string(rs.front()) + "-" + std::to_string(rs.back());
  std::string s;
  for (int r : rs) {
    if (!s.empty()) s += ',';
    s += std::to_string(r);
  }
  return s;
}

}  // namespace ringmaster

#include "actors/reform.hpp"

#include <algorithm>

namespace ringmaster {

namespace {

// Whether the job sends ring chunks between hosts to the nodes' ring ports: a sealed one always; one
// without keys when its launcher put the ports the nodes offered into the plan (remote_options::ring_ports),
// which shows as some node's port (every node has one when it listens on tcp).
bool uses_ring_ports(const job_plan& p) {
  return !p.seal_salt.empty() ||
         (p.nodes[0].key.empty() && std::any_of(p.nodes.begin(), p.nodes.end(), [](const plan_node& n) { return n.ring_port > 0; }));
}

// `ranks` (was: their number in current, or -1) as the ring of generation `generation`: renumbered in
// this order, neighbours, and the global batch cut into contiguous shards (the first B % M one larger).
bool make_ring(const job_plan& current, std::vector<rank_plan> ranks, int generation, uint64_t ring, int64_t start,
               job_plan* next, std::string* error) {
  if (ranks.empty()) return *error = "no rank is left to continue the job", false;
  const int m = int(ranks.size()), b = current.global_batch / m, extra = current.global_batch % m;
  job_plan p = current;
  p.generation = generation;
  p.ring = ring;
  p.start_step = start;
  p.recipient = -1;
  p.ranks = std::move(ranks);
  for (int i = 0, begin = 0; i < m; ++i) {
    rank_plan& r = p.ranks[size_t(i)];
    r.rank = i;
    r.left = (i + m - 1) % m;
    r.right = (i + 1) % m;
    r.batch_begin = begin;
    r.batch_end = begin += b + (i < extra ? 1 : 0);
  }
  if (!validate(p, error)) return false;
  *next = std::move(p);
  return true;
}

}  // namespace

bool make_reform(const job_plan& current, const std::vector<bool>& lost, int generation, uint64_t ring,
                 int64_t start, job_plan* next, std::string* error) {
  std::vector<rank_plan> survivors;
  for (const rank_plan& r : current.ranks)
    if (size_t(r.node) >= lost.size() || !lost[size_t(r.node)]) {
      survivors.push_back(r);
      survivors.back().was = r.rank;
    }
  return make_ring(current, std::move(survivors), generation, ring, start, next, error);
}

bool make_grow(const job_plan& current, int node, int ranks, const plan_node& entry, int generation, uint64_t ring,
               int64_t start, job_plan* next, std::string* error) {
  if (node < 0 || size_t(node) >= current.nodes.size() || !current.ranks_on(node).empty() || ranks < 1)
    return *error = "node " + std::to_string(node) + " cannot join with " + std::to_string(ranks) + " ranks", false;
  std::vector<rank_plan> all = current.ranks;
  for (rank_plan& r : all) r.was = r.rank;
  for (int i = 0; i < ranks; ++i) {
    rank_plan r;
    r.node = node;
    r.endpoint = current.nodes[size_t(node)].endpoint;
    r.device = current.device;
    r.was = -1;
    all.push_back(std::move(r));
  }
  job_plan grown = current;
  plan_node& nd = grown.nodes[size_t(node)];
  nd.id = entry.id;
  nd.host = entry.host;
  nd.ring_port = uses_ring_ports(current) ? entry.ring_port : 0;  // the one it has now
  if (entry.life <= nd.life)
    return *error = "node " + nd.endpoint + " cannot join in life " + std::to_string(entry.life) + ", not after its life " +
                    std::to_string(nd.life), false;
  nd.life = entry.life;  // a new life: its pair keys are new (net/seal.hpp)
  return make_ring(grown, std::move(all), generation, ring, start, next, error);
}

std::string check_reform(const job_plan& current, const job_plan& next) {
  if (next.job_id != current.job_id) return "the re-formed plan is for job " + std::to_string(next.job_id);
  if (next.generation <= current.generation)
    return "generation " + std::to_string(next.generation) + " does not follow generation " + std::to_string(current.generation);
  if (next.ring_id() == current.ring_id()) return "the re-formed ring has the id of the ring it replaces";
  if (next.recipient != current.recipient)
    return "the re-formed plan is addressed to node " + std::to_string(next.recipient) + ", this is node " + std::to_string(current.recipient);
  if (next.nodes.size() != current.nodes.size()) return "the re-formed plan changes the job's nodes";
  // Nodes that run ranks now and none before join the ring: as they came back, with a new routing id,
  // host or ring port, maybe, and always in a new life, whose pair keys are new (net/seal.hpp).
  std::vector<bool> joins(current.nodes.size(), false);
  for (const rank_plan& r : next.ranks)
    if (r.node >= 0 && size_t(r.node) < joins.size()) joins[size_t(r.node)] = current.ranks_on(r.node).empty();
  for (size_t i = 0; i < joins.size(); ++i)
    if (joins[i] && next.nodes[i].life <= current.nodes[i].life)
      return "node " + next.nodes[i].endpoint + " joins the ring in life " + std::to_string(next.nodes[i].life) +
             ", not after its life " + std::to_string(current.nodes[i].life) + ": it would seal with an earlier life's keys";
  // Everything but the ranks, what names the generation and a joining node's id, host, port and life
  // must be as it was, first_step aside: that is where this node started, and a node that joined did
  // so later than the rest (launcher_rejoin.cpp), yet takes the rings after as they do (node_job keeps
  // its own).
  auto settings = [&joins](job_plan p) {
    p.generation = 0;
    p.ring = 0;
    p.start_step = 0;
    p.first_step = 0;
    p.ranks.clear();
    for (size_t i = 0; i < joins.size() && i < p.nodes.size(); ++i)
      if (joins[i]) p.nodes[i].id = p.nodes[i].host = "", p.nodes[i].ring_port = p.nodes[i].life = 0;
    return to_json(p);
  };
  if (settings(current) != settings(next)) return "the re-formed plan changes the job's settings or nodes";
  std::vector<int> kept(current.nodes.size(), 0);
  for (const rank_plan& r : next.ranks) {
    if ((r.was < 0) != joins[size_t(r.node)])
      return "rank " + std::to_string(r.rank) + (r.was < 0 ? " joins on node " : " was running before on node ") +
             next.nodes[size_t(r.node)].endpoint + (r.was < 0 ? ", which runs ranks already" : ", which joins the ring");
    if (r.was < 0) continue;
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

int64_t rejoin_step(int64_t seen, int64_t spe, int64_t total_steps, int64_t ahead, int64_t least) {
  if (spe <= 0 || seen < 0 || total_steps <= spe) return -1;
  const int64_t at = (seen + std::max<int64_t>(0, ahead) + spe - 1) / spe * spe;
  if (at < total_steps) return at;
  const int64_t last = (total_steps - 1) / spe * spe;  // the last epoch's start: the end of the one before
  return last > 0 && last >= seen + std::max<int64_t>(0, least) ? last : -1;
}

std::chrono::steady_clock::time_point piece_clock(std::chrono::steady_clock::time_point asked, std::chrono::steady_clock::time_point now,
                                                  double state_bytes) {
  const auto whole = std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(state_bytes / 10e6));
  return std::min(now, asked + whole);
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

// judge_states (actors/state_verdict.hpp): which nodes the ranks' checksums of their states show
// faulty, when rank 0's node sent a state that not every rank holds. Each node has one say.
#include <catch2/catch.hpp>
#include <string>
#include <utility>
#include <vector>

#include "actors/state_verdict.hpp"

using namespace ringmaster;

namespace {

using faults = std::vector<std::pair<std::string, std::string>>;

const uint64_t kHeld = 0x1111, kOther = 0x2222, kThird = 0x3333;

}  // namespace

TEST_CASE("state verdict: a node whose ranks all hold the state sent is no one's fault", "[coordinator]") {
  const state_verdict v = judge_states({{0, kHeld, "node A"}, {1, kHeld, "node B"}}, "node A", kHeld, 50);
  CHECK(v.agree);
  CHECK(v.faulty.empty());
  CHECK(v.sender_ok);
}

TEST_CASE("state verdict: a sender whose own ranks hold another state is faulty, even of 2 nodes", "[coordinator]") {
  // As ringmaster-node --lie-in-states: rank 0's node changes the state it sends, its ranks report the truth.
  const state_verdict v = judge_states({{1, kHeld, "node B"}, {0, kHeld, "node A"}}, "node A", kOther, 50);
  CHECK_FALSE(v.agree);
  CHECK(v.disagree == "ranks 0 (node A), 1 (node B)");  // rank order, whatever the reports' order
  CHECK(v.decided);
  CHECK_FALSE(v.sender_ok);
  CHECK(v.faulty == faults{{"node A", "it sent rank 0's state after step 50, which its own ranks do not hold"}});
  CHECK(faults_named(v) == ": node A, it sent rank 0's state after step 50, which its own ranks do not hold");
  // At a re-forming the launcher asks any rank that finished the step for its state: the words name it.
  const state_verdict w = judge_states({{1, kHeld, "node B"}, {0, kHeld, "node A"}}, "node B", kOther, 50, 1);
  CHECK(w.decided);
  CHECK_FALSE(w.sender_ok);
  CHECK(w.faulty == faults{{"node B", "it sent rank 1's state after step 50, which its own ranks do not hold"}});
}

TEST_CASE("state verdict: two nodes that disagree, each true to itself: no one can tell which lies", "[coordinator]") {
  const state_verdict v = judge_states({{0, kOther, "node A"}, {1, kHeld, "node B"}}, "node A", kOther, 50);
  CHECK_FALSE(v.agree);
  CHECK(v.disagree == "rank 1 (node B)");
  CHECK_FALSE(v.decided);
  // Four nodes split two against two: neither half is a majority.
  const state_verdict w = judge_states({{0, kOther, "node A"}, {1, kOther, "node B"}, {2, kHeld, "node C"}, {3, kHeld, "node D"}}, "node A", kOther, 7);
  CHECK_FALSE(w.decided);
}

TEST_CASE("state verdict: of 3 nodes, the one the other two contradict is faulty, sender or not", "[coordinator]") {
  // A node that is not rank 0's reports another state: it goes, and the state sent may be written.
  state_verdict v = judge_states({{0, kHeld, "node A"}, {1, kOther, "node B"}, {2, kHeld, "node C"}}, "node A", kHeld, 50);
  CHECK(v.decided);
  CHECK(v.sender_ok);
  CHECK(v.faulty == faults{{"node B", "its ranks hold another state after step 50 than node A and node C hold"}});
  // Rank 0's node lies in its state and in its ranks' checksums alike: outvoted.
  v = judge_states({{0, kOther, "node A"}, {1, kHeld, "node B"}, {2, kHeld, "node C"}}, "node A", kOther, 50);
  CHECK(v.decided);
  CHECK_FALSE(v.sender_ok);
  CHECK(v.faulty == faults{{"node A", "its ranks hold another state after step 50 than node B and node C hold"}});
}

TEST_CASE("state verdict: a node counts once, whatever its ranks, and one whose ranks disagree is faulty", "[coordinator]") {
  // Node A runs 3 ranks that hold the lie: still one say against B's and C's.
  state_verdict v = judge_states({{0, kOther, "node A"}, {1, kOther, "node A"}, {2, kOther, "node A"}, {3, kHeld, "node B"}, {4, kHeld, "node C"}},
                                 "node A", kOther, 9);
  CHECK(v.decided);
  CHECK_FALSE(v.sender_ok);
  CHECK(v.faulty == faults{{"node A", "its ranks hold another state after step 9 than node B and node C hold"}});
  // Node C's two ranks disagree with each other: it is faulty by its own word, and A and B (both holding
  // the state sent) are the majority of the rest.
  v = judge_states({{0, kHeld, "node A"}, {1, kHeld, "node B"}, {2, kHeld, "node C"}, {3, kThird, "node C"}}, "node A", kHeld, 9);
  CHECK(v.decided);
  CHECK(v.sender_ok);
  CHECK(v.disagree == "rank 3 (node C)");
  CHECK(v.faulty == faults{{"node C", "its ranks hold different states after step 9"}});
}

TEST_CASE("state verdict: a sender with no rank left to vote is judged by what the others hold", "[coordinator]") {
  // Rank 0's node was lost after sending (its ranks' reports went with it): B and C hold another state.
  const state_verdict v = judge_states({{1, kHeld, "node B"}, {2, kHeld, "node C"}}, "node A", kOther, 12);
  CHECK(v.decided);
  CHECK_FALSE(v.sender_ok);
  CHECK(v.faulty == faults{{"node A", "it sent rank 0's state after step 12, which node B and node C do not hold"}});
  // One witness alone does not bar it: the state is not written, and nobody is named.
  const state_verdict w = judge_states({{1, kHeld, "node B"}}, "node A", kOther, 12);
  CHECK(w.decided);
  CHECK_FALSE(w.sender_ok);
  CHECK(w.faulty.empty());
}

TEST_CASE("state verdict: nodes faulty by their own word do not vote, and a tie among the rest decides nothing", "[coordinator]") {
  // A's ranks disagree among themselves; B and C, true to themselves, disagree with each other.
  const state_verdict v = judge_states({{0, kHeld, "node A"}, {1, kOther, "node A"}, {2, kHeld, "node B"}, {3, kThird, "node C"}}, "node A", kHeld, 4);
  CHECK_FALSE(v.agree);
  CHECK_FALSE(v.decided);
  // Of four voters, three are a majority (B is faulty by its own word, and does not count).
  const state_verdict w = judge_states({{0, kHeld, "node A"}, {1, kOther, "node B"}, {2, kThird, "node B"}, {3, kOther, "node C"}, {4, kHeld, "node D"},
                                        {5, kHeld, "node E"}}, "node A", kHeld, 4);
  CHECK(w.decided);
  CHECK(w.faulty == faults{{"node B", "its ranks hold different states after step 4"},
                           {"node C", "its ranks hold another state after step 4 than node A, node D and node E hold"}});
  // B faulty by its own word; A (true to itself) and C disagree, one each: undecided.
  const state_verdict x = judge_states({{0, kOther, "node A"}, {1, kHeld, "node B"}, {2, kOther, "node B"}, {3, kHeld, "node C"}}, "node A", kOther, 4);
  CHECK_FALSE(x.decided);
}

TEST_CASE("state verdict: ranks not named by where they run decide nothing", "[coordinator]") {
  CHECK_FALSE(judge_states({{0, kOther, ""}, {1, kHeld, ""}, {2, kHeld, ""}}, "", kOther, 3).decided);
  CHECK_FALSE(judge_states({{0, kOther, "node A"}, {1, kHeld, "node B"}, {2, kHeld, ""}}, "node A", kOther, 3).decided);
}

// Pipeline schedules: each chunk's layers, Megatron's order on hand-checked cases, the structural
// properties every generated schedule must have for pp 1..8 and vpp 1..4, the bubble and activation
// peaks the simulator measures, and the simulator's diagnosis of deliberately broken schedules.
#include "parallel/schedule.h"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <tuple>

#include "lib/core/error.h"

using namespace mpigpt;

namespace {

bool is_compute(ActionType t) { return t == ActionType::Forward || t == ActionType::Backward; }

// Megatron's warm-up length, restated from schedules.py for the expected activation peaks.
int warmup(int pp, int vpp, int m, int r) {
  return vpp == 1 ? std::min(pp - r - 1, m) : std::min(2 * (pp - r - 1) + (vpp - 1) * pp, m * vpp);
}

// The structural properties of a generated schedule, asserted rank by rank.
void check_structure(const Schedule& s, int pp, int vpp, int m) {
  REQUIRE(int(s.size()) == pp);
  const int last = pp * vpp - 1;
  for (int r = 0; r < pp; ++r) {
    CAPTURE(r);
    const std::vector<Action>& a = s[r];
    const int prev = (r + pp - 1) % pp, next = (r + 1) % pp;
    std::map<std::pair<int, int>, int> fwd_at, bwd_at;  // (mb, chunk) -> position
    std::vector<int> last_f(vpp, -1), last_b(vpp, -1);
    // (direction, send?, chunk) -> last micro-batch: the order MPI's per-tag FIFO matching needs
    std::map<std::tuple<char, bool, int>, int> last_msg;
    int comm_actions = 0, expected_comm = 0;
    for (int i = 0; i < int(a.size()); ++i) {
      const Action& x = a[i];
      REQUIRE(x.chunk >= 0);
      REQUIRE(x.chunk < vpp);
      REQUIRE(x.mb >= 0);
      REQUIRE(x.mb < m);
      if (!is_compute(x.type)) {
        ++comm_actions;
        const bool send = x.type == ActionType::SendForward || x.type == ActionType::SendBackward;
        const char dir = (x.type == ActionType::SendForward || x.type == ActionType::RecvForward) ? 'F' : 'B';
        auto [it, first] = last_msg.try_emplace({dir, send, x.chunk}, x.mb);
        if (!first) {
          CHECK_MESSAGE(x.mb > it->second, "messages of one link out of order at ", to_string(x));
          it->second = x.mb;
        }
        continue;
      }
      const int st = virtual_stage(pp, r, x.chunk);
      if (x.type == ActionType::Forward) {
        CHECK_MESSAGE(fwd_at.emplace(std::pair{x.mb, x.chunk}, i).second, "second ", to_string(x));
        CHECK_MESSAGE(x.mb > last_f[x.chunk], "forwards of chunk ", x.chunk, " not in increasing order at ", to_string(x));
        last_f[x.chunk] = x.mb;
        // the input arrives right before, the output leaves right after
        if (st > 0) {
          REQUIRE(i > 0);
          CHECK(a[i - 1] == Action{ActionType::RecvForward, x.mb, x.chunk, prev});
        }
        if (st < last) {
          REQUIRE(i + 1 < int(a.size()));
          CHECK(a[i + 1] == Action{ActionType::SendForward, x.mb, x.chunk, next});
        }
        expected_comm += (st > 0) + (st < last);
      } else {
        CHECK_MESSAGE(bwd_at.emplace(std::pair{x.mb, x.chunk}, i).second, "second ", to_string(x));
        CHECK_MESSAGE(x.mb > last_b[x.chunk], "backwards of chunk ", x.chunk, " not in increasing order at ", to_string(x));
        last_b[x.chunk] = x.mb;
        auto f = fwd_at.find({x.mb, x.chunk});
        CHECK_MESSAGE(f != fwd_at.end(), to_string(x), " before its forward");
        if (st < last) {
          REQUIRE(i > 0);
          CHECK(a[i - 1] == Action{ActionType::RecvBackward, x.mb, x.chunk, next});
        }
        if (st > 0) {
          REQUIRE(i + 1 < int(a.size()));
          CHECK(a[i + 1] == Action{ActionType::SendBackward, x.mb, x.chunk, prev});
        }
        expected_comm += (st > 0) + (st < last);
      }
    }
    CHECK(int(fwd_at.size()) == m * vpp);  // with the no-duplicate checks: each (mb, chunk) exactly once
    CHECK(int(bwd_at.size()) == m * vpp);
    CHECK(comm_actions == expected_comm);  // no message beyond the ones around compute
  }
}

}  // namespace

TEST_CASE("chunk v on pipeline rank p holds virtual stage v*pp+p's layers; all layers exactly once") {
  using Ranges = std::vector<std::pair<int, int>>;
  CHECK(layers_of_stage({2, 2, 2, 2}, 2, 1) == Ranges{{2, 4}, {6, 8}});
  CHECK(layers_of_stage({2, 2, 2, 2}, 4, 3) == Ranges{{6, 8}});
  // Uneven: stages of 1, 3, 3, 1 layers; pp 2 x vpp 2 puts stages 1 and 3 on rank 1.
  CHECK(layers_of_stage({1, 3, 3, 1}, 2, 0) == Ranges{{0, 1}, {4, 7}});
  CHECK(layers_of_stage({1, 3, 3, 1}, 2, 1) == Ranges{{1, 4}, {7, 8}});
  CHECK(layers_of_stage({0, 5, 3}, 3, 0) == Ranges{{0, 0}});  // a stage may hold no layer
  for (const std::vector<int>& stages : std::vector<std::vector<int>>{{16}, {8, 8}, {4, 4, 4, 4}, {3, 5, 6, 2},
                                                                       {2, 2, 2, 2, 2, 2, 2, 2}, {0, 7, 9, 0}})
    for (int pp : {1, 2, 4}) {
      if (stages.size() % size_t(pp) != 0) continue;
      std::multiset<int> all;
      for (int p = 0; p < pp; ++p)
        for (const auto& [first, end] : layers_of_stage(stages, pp, p))
          for (int l = first; l < end; ++l) all.insert(l);
      CHECK(all.size() == 16);
      CHECK(std::set<int>(all.begin(), all.end()).size() == 16);
    }
}

TEST_CASE("make_schedule rejects impossible layouts, naming the fields and the fix") {
  CHECK_THROWS_WITH_AS(make_schedule(0, 1, 4), doctest::Contains("parallel.pp = 0"), Error);
  CHECK_THROWS_WITH_AS(make_schedule(2, 0, 4), doctest::Contains("parallel.vpp = 0"), Error);
  CHECK_THROWS_WITH_AS(make_schedule(2, 1, 0), doctest::Contains("training.global_batch"), Error);
  CHECK_THROWS_WITH_AS(make_schedule(4, 2, 6),
                       doctest::Contains("training.global_batch / (training.micro_batch * data-parallel size) = 6, "
                                         "to be a multiple of parallel.pp = 4: change global_batch or micro_batch "
                                         "so that it is e.g. 4 or 8, or set parallel.vpp = 1"),
                       Error);
  CHECK_THROWS_WITH_AS(make_schedule(4, 2, 2), doctest::Contains("so that it is e.g. 4 or 8"), Error);
  CHECK_THROWS_WITH_AS(make_schedule(4, 3, 9), doctest::Contains("so that it is e.g. 8 or 12"), Error);
  CHECK_NOTHROW(make_schedule(4, 1, 6));  // plain 1F1B takes any number of micro-batches
  CHECK_NOTHROW(make_schedule(4, 1, 1));
  CHECK_NOTHROW(make_schedule(2, 2, 2));  // pp 2 with vpp 2 works (Megatron forbids it for its p2p overlap)
}

TEST_CASE("plain 1F1B: warm-up forwards, one forward one backward, cool-down backwards") {
  CHECK(to_string(make_schedule(4, 1, 6), true) ==
        "rank 0: F0.0 F1.0 F2.0 F3.0 B0.0 F4.0 B1.0 F5.0 B2.0 B3.0 B4.0 B5.0\n"
        "rank 1: F0.0 F1.0 F2.0 B0.0 F3.0 B1.0 F4.0 B2.0 F5.0 B3.0 B4.0 B5.0\n"
        "rank 2: F0.0 F1.0 B0.0 F2.0 B1.0 F3.0 B2.0 F4.0 B3.0 F5.0 B4.0 B5.0\n"
        "rank 3: F0.0 B0.0 F1.0 B1.0 F2.0 B2.0 F3.0 B3.0 F4.0 B4.0 F5.0 B5.0\n");
  // the messages: receive right before the compute, send right after
  CHECK(to_string(make_schedule(2, 1, 2)) ==
        "rank 0: F0.0 sF0.0>1 F1.0 sF1.0>1 rB0.0<1 B0.0 rB1.0<1 B1.0\n"
        "rank 1: rF0.0<0 F0.0 B0.0 sB0.0>0 rF1.0<0 F1.0 B1.0 sB1.0>0\n");
  // fewer micro-batches than stages: the warm-up is capped at m
  CHECK(to_string(make_schedule(4, 1, 2)[0], true) == "F0.0 F1.0 B0.0 B1.0");
}

TEST_CASE("interleaved 1F1B follows Megatron's order") {
  // pp 4, vpp 2, m 8, the case drawn in Figure 4 of Narayanan et al. 2021 ("Efficient
  // large-scale language model training on GPU clusters"). Forward virtual micro-batch k is
  // micro-batch (k / 8) * 4 + k % 4 of chunk (k % 8) / 4; backwards run the chunks in reverse.
  // Rank 0 warms up with 2*(4-0-1) + (2-1)*4 = 10 forwards, rank 3 with 4.
  const Schedule s = make_schedule(4, 2, 8);
  CHECK(to_string(s[0], true) ==
        "F0.0 F1.0 F2.0 F3.0 F0.1 F1.1 F2.1 F3.1 F4.0 F5.0 "         // warm-up
        "F6.0 B0.1 F7.0 B1.1 F4.1 B2.1 F5.1 B3.1 F6.1 B0.0 F7.1 B1.0 "  // steady 1F1B
        "B2.0 B3.0 B4.1 B5.1 B6.1 B7.1 B4.0 B5.0 B6.0 B7.0");          // cool-down
  CHECK(to_string(s[3], true) ==
        "F0.0 F1.0 F2.0 F3.0 F0.1 B0.1 F1.1 B1.1 F2.1 B2.1 F3.1 B3.1 F4.0 B0.0 F5.0 B1.0 F6.0 B2.0 F7.0 B3.0 "
        "F4.1 B4.1 F5.1 B5.1 F6.1 B6.1 F7.1 B7.1 B4.0 B5.0 B6.0 B7.0");
  // The activation of the last rank's chunk 0 goes round the ring to rank 0's chunk 1.
  const Schedule t = make_schedule(2, 2, 2);
  CHECK(to_string(t) ==
        "rank 0: F0.0 sF0.0>1 F1.0 sF1.0>1 rF0.1<1 F0.1 sF0.1>1 rF1.1<1 F1.1 sF1.1>1 "
        "rB0.1<1 B0.1 sB0.1>1 rB1.1<1 B1.1 sB1.1>1 rB0.0<1 B0.0 rB1.0<1 B1.0\n"
        "rank 1: rF0.0<0 F0.0 sF0.0>0 rF1.0<0 F1.0 sF1.0>0 rF0.1<0 F0.1 B0.1 sB0.1>0 "
        "rF1.1<0 F1.1 B1.1 sB1.1>0 rB0.0<0 B0.0 sB0.0>0 rB1.0<0 B1.0 sB1.0>0\n");
  // m == pp: the warm-up is capped at m*vpp, so rank 0 runs every forward first while the last
  // rank still starts 1F1B after (vpp-1)*pp forwards (Megatron-Core; older Megatron-LM made
  // every rank all warm-up here, for the same bubble and more activation memory).
  const Schedule u = make_schedule(4, 2, 4);
  CHECK(to_string(u[0], true) == "F0.0 F1.0 F2.0 F3.0 F0.1 F1.1 F2.1 F3.1 B0.1 B1.1 B2.1 B3.1 B0.0 B1.0 B2.0 B3.0");
  CHECK(to_string(u[3], true) == "F0.0 F1.0 F2.0 F3.0 F0.1 B0.1 F1.1 B1.1 F2.1 B2.1 F3.1 B3.1 B0.0 B1.0 B2.0 B3.0");
}

// Why the bubble formula is exact: with equal costs on every virtual stage and instantaneous
// messages, the first micro-batch needs (pp-1) forward times to reach the last rank and the
// last gradient (pp-1) backward times to get back to rank 0; in between Megatron's warm-up
// keeps every rank supplied, so no other gap opens, for every forward:backward ratio (checked
// from 1:0.01 to 1:100). Each rank thus idles (pp-1)(f+b) against m*vpp*(f+b) of work:
// bubble = (pp-1)/(vpp*m). Unequal stage costs (the slowest stage sets the pace) and message
// latency (below) make it larger.
TEST_CASE("every schedule is well-formed, matched, deadlock-free, with bubble (pp-1)/(vpp*m)") {
  int cases = 0;
  for (int pp = 1; pp <= 8; ++pp)
    for (int vpp = 1; vpp <= 4; ++vpp) {
      std::set<int> ms = {pp, 2 * pp, 3 * pp, 4 * pp};
      if (vpp == 1)
        for (int m = 1; m <= 2 * pp + 1; ++m) ms.insert(m);  // plain 1F1B takes any m
      for (int m : ms) {
        CAPTURE(pp);
        CAPTURE(vpp);
        CAPTURE(m);
        const Schedule s = make_schedule(pp, vpp, m);
        check_structure(s, pp, vpp, m);
        for (double b : {0.01, 0.5, 1.0, 2.0, 3.0, 100.0}) {
          CAPTURE(b);
          const SimResult r = simulate(s, pp, vpp, 1.0, b);
          CHECK_MESSAGE(r.ok(), (r.errors.empty() ? std::string() : r.errors[0]));
          CHECK(!r.deadlock);
          CHECK(r.unmatched == 0);
          CHECK(r.ideal == doctest::Approx(m * vpp * (1.0 + b)));
          CHECK(r.bubble == doctest::Approx(double(pp - 1) / (vpp * m)).epsilon(1e-12));
          for (int rank = 0; rank < pp; ++rank) {
            CAPTURE(rank);
            // the activation peak: the warm-up forwards plus the one of the first 1F1B pair
            CHECK(r.peak_in_flight[rank] == std::min(warmup(pp, vpp, m, rank) + 1, m * vpp));
            if (vpp == 1) CHECK(r.peak_in_flight[rank] == std::min(pp - rank, m));
          }
        }
        ++cases;
      }
    }
  CHECK(cases == 191);
}

TEST_CASE("message latency: interleaving hides it in the steady state, plain 1F1B does not") {
  // With latency L, a schedule pays at least the hops of the first micro-batch's way there and
  // back, 2*(pp*vpp - 1)*L. Interleaved 1F1B pays only that while L <= min(f, b): the two extra
  // warm-up forwards per downstream rank (Megatron's "* 2") leave a compute slot of slack for
  // each round trip. Plain 1F1B has no slack; its steady state waits for round trips too.
  const double f = 1, b = 2, L = 0.25;
  for (int pp : {2, 3, 4, 8})
    for (int vpp : {1, 2, 3}) {
      for (int m : {pp, 2 * pp, 4 * pp}) {
        CAPTURE(pp);
        CAPTURE(vpp);
        CAPTURE(m);
        const Schedule s = make_schedule(pp, vpp, m);
        const double extra = simulate(s, pp, vpp, f, b, L).makespan - simulate(s, pp, vpp, f, b).makespan;
        const double hops = 2.0 * (pp * vpp - 1) * L;
        if (vpp > 1)
          CHECK(extra == doctest::Approx(hops));
        else if (m > pp)
          CHECK(extra > hops + L);
        else
          CHECK(extra >= hops - 1e-9);
      }
    }
}

TEST_CASE("the simulator's timing on small cases worked by hand") {
  // pp 2, one micro-batch: F on rank 0, hop, F and B on rank 1, hop, B on rank 0.
  const SimResult r = simulate(make_schedule(2, 1, 1), 2, 1, 1.0, 2.0, 0.5);
  CHECK(r.ok());
  CHECK(r.makespan == doctest::Approx(1 + 0.5 + 1 + 2 + 0.5 + 2));
  CHECK(r.finish[1] == doctest::Approx(4.5));
  CHECK(r.busy == std::vector<double>{3.0, 3.0});
  // Per-stage costs: a last stage half again as slow (the loss) sets the pace of 1F1B.
  SimCosts c;
  c.forward = {1, 1, 1, 1.5};
  c.backward = {2, 2, 2, 3};
  const SimResult u = simulate(make_schedule(4, 1, 8), 4, 1, c);
  CHECK(u.ok());
  CHECK(u.ideal == doctest::Approx(8 * 4.5));
  CHECK(u.makespan == doctest::Approx(3 * 3 + 8 * 4.5));  // fill and drain at the fast stages, steady at the slow one
  CHECK_THROWS_WITH_AS(simulate(make_schedule(2, 1, 2), 2, 1, SimCosts{{1, 2, 3}, {1}, 0}),
                       doctest::Contains("forward costs has 3 entries"), Error);
  CHECK_THROWS_WITH_AS(simulate(make_schedule(2, 1, 2), 3, 1, 1.0, 2.0), doctest::Contains("the schedule has 2 ranks"),
                       Error);
}

TEST_CASE("the simulator finds unmatched messages and deadlocks in broken schedules") {
  auto erase = [](std::vector<Action>& v, Action a) {
    auto it = std::find(v.begin(), v.end(), a);
    REQUIRE(it != v.end());
    v.erase(it);
  };
  auto has = [](const SimResult& r, const std::string& text) {
    return std::any_of(r.errors.begin(), r.errors.end(), [&](const std::string& e) { return e.find(text) != e.npos; });
  };

  SUBCASE("a send left out: the receiver waits for a message no rank sends") {
    Schedule s = make_schedule(2, 1, 2);
    erase(s[0], {ActionType::SendForward, 1, 0, 1});
    const SimResult r = simulate(s, 2, 1, 1.0, 2.0);
    CHECK(r.deadlock);
    CHECK(r.unmatched == 1);
    CHECK(has(r, "unmatched receive: rank 1 runs rF1.0<0 but rank 0 never sends it"));
    CHECK(has(r, "rank 1 waits at rF1.0<0 (action 4 of 8) for a message no rank sends"));
    CHECK(has(r, "rank 0 waits at rB1.0<1 (action 5 of 7) for a message rank 1 has not sent yet"));
  }
  SUBCASE("a receive left out: the send is unmatched, nothing hangs") {
    Schedule s = make_schedule(2, 1, 2);
    erase(s[1], {ActionType::RecvForward, 1, 0, 0});
    const SimResult r = simulate(s, 2, 1, 1.0, 2.0);
    CHECK(!r.deadlock);
    CHECK(r.unmatched == 1);
    CHECK(has(r, "unmatched send: rank 0 runs sF1.0>1 but rank 1 never receives it"));
  }
  SUBCASE("a doubled send") {
    Schedule s = make_schedule(2, 1, 2);
    s[0].insert(s[0].begin() + 2, Action{ActionType::SendForward, 0, 0, 1});
    const SimResult r = simulate(s, 2, 1, 1.0, 2.0);
    CHECK(r.unmatched == 1);
    CHECK(has(r, "doubled message: rank 0 sends sF0.0>1 2 times, rank 1 receives it 1 times"));
  }
  SUBCASE("the wrong peer") {
    Schedule s = make_schedule(4, 1, 4);
    for (Action& a : s[2])
      if (a.type == ActionType::RecvForward && a.mb == 2) a.peer = 3;
    const SimResult r = simulate(s, 4, 1, 1.0, 2.0);
    CHECK(r.deadlock);
    CHECK(r.unmatched == 2);  // rank 1's send finds no receive, rank 2's receive no send
  }
  SUBCASE("every message matched, but each rank first waits for the other: a true deadlock") {
    // Rank 0 waits for the gradient of micro-batch 0 before sending its activation.
    Schedule s = make_schedule(2, 1, 1);
    CHECK(to_string(s[0]) == "F0.0 sF0.0>1 rB0.0<1 B0.0");
    std::swap(s[0][1], s[0][2]);
    const SimResult r = simulate(s, 2, 1, 1.0, 2.0);
    CHECK(r.unmatched == 0);
    CHECK(r.deadlock);
    CHECK(has(r, "deadlock: rank 0 waits at rB0.0<1 (action 1 of 4) for a message rank 1 has not sent yet; "
                 "rank 1 waits at rF0.0<0 (action 0 of 4) for a message rank 0 has not sent yet"));
  }
  SUBCASE("actions that cannot exist") {
    Schedule s = make_schedule(2, 2, 2);
    s[1].push_back({ActionType::Forward, 0, 2, -1});
    s[0].insert(s[0].begin(), Action{ActionType::RecvForward, 0, 0, 1});
    const SimResult r = simulate(s, 2, 2, 1.0, 2.0);
    CHECK(has(r, "rank 1: F0.2 names chunk 2 of 2"));
    CHECK(has(r, "rank 0: rF0.0<1 on virtual stage 0, which has no previous stage"));
  }
}

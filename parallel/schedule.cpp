// Pipeline schedules: the 1F1B generators (plain and interleaved, following Megatron-LM's
// schedules.py) and the event-replay simulator.
#include "parallel/schedule.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <numeric>
#include <tuple>

#include "lib/core/error.h"

namespace mpigpt {

namespace {

struct Compute {
  bool forward;
  int mb, chunk;
};

// Megatron's virtual micro-batch k (0 .. m*vpp-1): micro-batches go through the chunks in
// groups of pp, chunk 0 first for forwards and the last chunk first for backwards
// (get_model_chunk_id with microbatch_group_size_per_vp_stage = pp). For vpp == 1 this is
// micro-batch k of chunk 0.
Compute virtual_microbatch(int pp, int vpp, int k, bool forward) {
  const int group = pp * vpp, in_group = k % group;
  const int chunk = in_group / pp;
  return {forward, (k / group) * pp + k % pp, forward ? chunk : vpp - 1 - chunk};
}

// How many forwards rank `rank` runs before its first backward.
int warmup_count(int pp, int vpp, int m, int rank) {
  if (vpp == 1) return std::min(pp - rank - 1, m);
  // (vpp-1)*pp forwards fill every chunk but the last; two more per rank downstream give each
  // rank the slack to hide a message round trip in the steady state (schedule_test measures
  // it). Megatron-LM before Megatron-Core also made m == pp all warm-up on every rank; Core
  // only caps, which keeps the bubble and lowers the later ranks' activation peak.
  return std::min((pp - rank - 1) * 2 + (vpp - 1) * pp, m * vpp);
}

// The compute order of one rank: warm-up forwards, then one forward and one backward
// alternating, then the remaining backwards.
std::vector<Compute> compute_order(int pp, int vpp, int m, int rank) {
  const int total = m * vpp, warmup = warmup_count(pp, vpp, m, rank);
  std::vector<Compute> order;
  order.reserve(2 * total);
  for (int k = 0; k < warmup; ++k) order.push_back(virtual_microbatch(pp, vpp, k, true));
  for (int k = 0; k < total - warmup; ++k) {
    order.push_back(virtual_microbatch(pp, vpp, warmup + k, true));
    order.push_back(virtual_microbatch(pp, vpp, k, false));
  }
  for (int k = total - warmup; k < total; ++k) order.push_back(virtual_microbatch(pp, vpp, k, false));
  return order;
}

char direction_letter(ActionType t) {
  return (t == ActionType::Forward || t == ActionType::SendForward || t == ActionType::RecvForward) ? 'F' : 'B';
}

bool is_send(ActionType t) { return t == ActionType::SendForward || t == ActionType::SendBackward; }
bool is_recv(ActionType t) { return t == ActionType::RecvForward || t == ActionType::RecvBackward; }

// A message: (sender, receiver, direction 0 = forward / 1 = backward, micro-batch, boundary),
// where the boundary is the lower virtual stage of the two it connects.
using MsgKey = std::tuple<int, int, int, int, int>;

MsgKey message_of(const Action& a, int rank, int pp) {
  const int s = virtual_stage(pp, rank, a.chunk);
  switch (a.type) {
    case ActionType::SendForward: return {rank, a.peer, 0, a.mb, s};
    case ActionType::RecvForward: return {a.peer, rank, 0, a.mb, s - 1};
    case ActionType::SendBackward: return {rank, a.peer, 1, a.mb, s - 1};
    case ActionType::RecvBackward: return {a.peer, rank, 1, a.mb, s};
    default: return {};
  }
}

double cost_of(const std::vector<double>& costs, int stage) { return costs.size() == 1 ? costs[0] : costs[stage]; }

void check_costs(const std::vector<double>& costs, const char* what, int stages) {
  if (costs.size() != 1 && int(costs.size()) != stages)
    fail("simulate: {} costs has {} entries; give one per virtual stage ({}) or one for all", what, costs.size(),
         stages);
  for (double c : costs)
    if (!(c >= 0)) fail("simulate: {} cost {} is negative or NaN", what, c);
}

// Where the action is malformed on its own (chunk, micro-batch or peer out of range), a
// description; empty when it is well-formed.
std::string malformed(const Action& a, int rank, int pp, int vpp) {
  const bool comm = is_send(a.type) || is_recv(a.type);
  if (a.chunk < 0 || a.chunk >= vpp) return fmt::format("rank {}: {} names chunk {} of {}", rank, to_string(a), a.chunk, vpp);
  if (a.mb < 0) return fmt::format("rank {}: {} names a negative micro-batch", rank, to_string(a));
  if (comm && (a.peer < 0 || a.peer >= pp))
    return fmt::format("rank {}: {} names peer {} outside the {} pipeline ranks", rank, to_string(a), a.peer, pp);
  const int s = virtual_stage(pp, rank, a.chunk);
  if ((a.type == ActionType::RecvForward || a.type == ActionType::SendBackward) && s == 0)
    return fmt::format("rank {}: {} on virtual stage 0, which has no previous stage", rank, to_string(a));
  if ((a.type == ActionType::SendForward || a.type == ActionType::RecvBackward) && s == pp * vpp - 1)
    return fmt::format("rank {}: {} on the last virtual stage, which has no next stage", rank, to_string(a));
  return {};
}

// Every message must be sent exactly once and received exactly once; report the others.
void match_messages(const Schedule& schedule, int pp, SimResult& res) {
  struct Ends {
    int sends = 0, recvs = 0;
    int send_rank = -1, recv_rank = -1;
    Action send, recv;
  };
  std::map<MsgKey, Ends> ends;
  for (int r = 0; r < pp; ++r)
    for (const Action& a : schedule[r]) {
      if (!is_send(a.type) && !is_recv(a.type)) continue;
      Ends& e = ends[message_of(a, r, pp)];
      if (is_send(a.type)) {
        if (e.sends++ == 0) e.send_rank = r, e.send = a;
      } else if (e.recvs++ == 0) {
        e.recv_rank = r, e.recv = a;
      }
    }
  for (const auto& [key, e] : ends) {
    const int from = std::get<0>(key), to = std::get<1>(key);
    if (e.sends == 0)
      res.errors.push_back(fmt::format("unmatched receive: rank {} runs {} but rank {} never sends it", e.recv_rank,
                                       to_string(e.recv), from));
    else if (e.recvs == 0)
      res.errors.push_back(fmt::format("unmatched send: rank {} runs {} but rank {} never receives it", e.send_rank,
                                       to_string(e.send), to));
    else if (e.sends > 1 || e.recvs > 1)
      res.errors.push_back(fmt::format("doubled message: rank {} sends {} {} times, rank {} receives it {} times",
                                       e.send_rank, to_string(e.send), e.sends, e.recv_rank, e.recvs));
    else
      continue;
    ++res.unmatched;
  }
}

// Messages numbered densely, (direction, micro-batch, boundary) -> one slot, when every send and
// receive names the neighbour its virtual stage implies (make_schedule's always do); -1 otherwise,
// and then the keyed matching above tells the mismatches apart.
struct DenseMessages {
  int pp, stages, mbs;
  int64_t slot(const Action& a, int rank) const {
    const int s = virtual_stage(pp, rank, a.chunk);
    const bool fwd = a.type == ActionType::SendForward || a.type == ActionType::RecvForward;
    const bool up = a.type == ActionType::SendForward || a.type == ActionType::RecvBackward;  // peer on s + 1
    if (a.peer != ((up ? s + 1 : s - 1) % pp + pp) % pp) return -1;
    const int boundary = up ? s : s - 1;
    return (int64_t(fwd ? 0 : 1) * mbs + a.mb) * stages + boundary;
  }
  int64_t size() const { return int64_t(2) * mbs * stages; }
};

// Whether every message is sent and received exactly once, counted on dense slots (cheap: the
// planner simulates thousands of schedules); false sends the caller to match_messages for words.
bool dense_messages_match(const Schedule& schedule, const DenseMessages& dm) {
  std::vector<int> sends(size_t(dm.size()), 0), recvs(size_t(dm.size()), 0);
  for (int r = 0; r < dm.pp; ++r)
    for (const Action& a : schedule[r]) {
      if (!is_send(a.type) && !is_recv(a.type)) continue;
      const int64_t k = dm.slot(a, r);
      if (k < 0) return false;
      ++(is_send(a.type) ? sends : recvs)[size_t(k)];
    }
  for (size_t k = 0; k < sends.size(); ++k)
    if (sends[k] != recvs[k] || sends[k] > 1) return false;
  return true;
}

}  // namespace

std::vector<std::pair<int, int>> layers_of_stage(const std::vector<int>& stage_layers, int pp, int pp_rank) {
  MPIGPT_CHECK(pp >= 1 && !stage_layers.empty() && stage_layers.size() % size_t(pp) == 0 && pp_rank < pp,
               "layers_of_stage: {} virtual stages over pp = {}", stage_layers.size(), pp);
  const int vpp = int(stage_layers.size()) / pp;
  std::vector<std::pair<int, int>> chunks;
  for (int v = 0; v < vpp; ++v) {
    const int s = virtual_stage(pp, pp_rank, v);
    const int first = std::accumulate(stage_layers.begin(), stage_layers.begin() + s, 0);
    chunks.push_back({first, first + stage_layers[size_t(s)]});
  }
  return chunks;
}

Schedule make_schedule(int pp, int vpp, int m) {
  if (pp < 1) fail("parallel.pp = {} must be at least 1", pp);
  if (vpp < 1) fail("parallel.vpp = {} must be at least 1 (1 = plain 1F1B, > 1 = interleaved)", vpp);
  if (m < 1)
    fail("a step needs at least one micro-batch per pipeline, got {}: make training.global_batch at least "
         "training.micro_batch * data-parallel size", m);
  if (vpp > 1 && m % pp != 0)
    fail("the interleaved schedule (parallel.vpp = {}) needs the number of micro-batches per step, "
         "training.global_batch / (training.micro_batch * data-parallel size) = {}, to be a multiple of "
         "parallel.pp = {}: change global_batch or micro_batch so that it is e.g. {} or {}, or set "
         "parallel.vpp = 1",
         vpp, m, pp, std::max(pp, m / pp * pp), std::max(pp, m / pp * pp) + pp);

  const int last = pp * vpp - 1;
  Schedule schedule(pp);
  for (int r = 0; r < pp; ++r) {
    const int prev = (r + pp - 1) % pp, next = (r + 1) % pp;
    std::vector<Action>& out = schedule[r];
    for (const Compute& c : compute_order(pp, vpp, m, r)) {
      const int s = virtual_stage(pp, r, c.chunk);
      if (c.forward) {
        if (s > 0) out.push_back({ActionType::RecvForward, c.mb, c.chunk, prev});
        out.push_back({ActionType::Forward, c.mb, c.chunk, -1});
        if (s < last) out.push_back({ActionType::SendForward, c.mb, c.chunk, next});
      } else {
        if (s < last) out.push_back({ActionType::RecvBackward, c.mb, c.chunk, next});
        out.push_back({ActionType::Backward, c.mb, c.chunk, -1});
        if (s > 0) out.push_back({ActionType::SendBackward, c.mb, c.chunk, prev});
      }
    }
  }
  return schedule;
}

std::string to_string(const Action& a) {
  const char d = direction_letter(a.type);
  switch (a.type) {
    case ActionType::Forward:
    case ActionType::Backward: return fmt::format("{}{}.{}", d, a.mb, a.chunk);
    case ActionType::SendForward:
    case ActionType::SendBackward: return fmt::format("s{}{}.{}>{}", d, a.mb, a.chunk, a.peer);
    case ActionType::RecvForward:
    case ActionType::RecvBackward: return fmt::format("r{}{}.{}<{}", d, a.mb, a.chunk, a.peer);
  }
  return "?";
}

std::string to_string(const std::vector<Action>& actions, bool compute_only) {
  std::string out;
  for (const Action& a : actions) {
    if (compute_only && a.type != ActionType::Forward && a.type != ActionType::Backward) continue;
    if (!out.empty()) out += ' ';
    out += to_string(a);
  }
  return out;
}

std::string to_string(const Schedule& schedule, bool compute_only) {
  std::string out;
  for (size_t r = 0; r < schedule.size(); ++r)
    out += fmt::format("rank {}: {}\n", r, to_string(schedule[r], compute_only));
  return out;
}

// The ranks a replay left before the end of their actions, each with the receive it waits at.
static std::string stuck_ranks(const Schedule& schedule, const std::vector<size_t>& pos, int pp) {
  std::string stuck;
  for (int r = 0; r < pp; ++r) {
    if (pos[r] == schedule[r].size()) continue;
    const Action& a = schedule[r][pos[r]];
    bool ever_sent = false;
    const MsgKey key = message_of(a, r, pp);
    for (const Action& b : schedule[a.peer])
      if (is_send(b.type) && message_of(b, a.peer, pp) == key) ever_sent = true;
    stuck += fmt::format("{}rank {} waits at {} (action {} of {}) for a message {}", stuck.empty() ? "" : "; ", r,
                         to_string(a), pos[r], schedule[r].size(),
                         ever_sent ? fmt::format("rank {} has not sent yet", a.peer) : std::string("no rank sends"));
  }
  return stuck;
}

SimResult simulate(const Schedule& schedule, int pp, int vpp, const SimCosts& costs) {
  if (pp < 1 || vpp < 1) fail("simulate: pp = {} and vpp = {} must be at least 1", pp, vpp);
  if (int(schedule.size()) != pp) fail("simulate: the schedule has {} ranks, pp = {}", schedule.size(), pp);
  check_costs(costs.forward, "forward", pp * vpp);
  check_costs(costs.backward, "backward", pp * vpp);
  if (!(costs.p2p_latency >= 0)) fail("simulate: p2p_latency {} is negative or NaN", costs.p2p_latency);

  SimResult res;
  res.busy.assign(pp, 0.0);
  res.finish.assign(pp, 0.0);
  res.peak_in_flight.assign(pp, 0);
  for (int r = 0; r < pp; ++r)
    for (const Action& a : schedule[r])
      if (std::string why = malformed(a, r, pp, vpp); !why.empty()) res.errors.push_back(why);
  if (!res.ok()) return res;  // the replay below relies on well-formed actions
  int mbs = 0;
  for (const auto& actions : schedule)
    for (const Action& a : actions) mbs = std::max(mbs, a.mb + 1);
  const DenseMessages dm{pp, pp * vpp, mbs};
  const bool dense = dense_messages_match(schedule, dm);
  if (!dense) match_messages(schedule, pp, res);

  // Replay: every rank runs until it meets a receive whose message is not sent yet; sweeping
  // the ranks until none moves gives the same times as any event order, because a rank's
  // times depend only on its own actions and the arrival times of the messages it receives.
  std::vector<size_t> pos(pp, 0);
  std::vector<double> clock(pp, 0.0);
  std::vector<int> in_flight(pp, 0);
  std::map<MsgKey, double> arrival;  // keyed when the dense slots do not apply
  std::vector<double> arrived(dense ? size_t(dm.size()) : 0, -1.0);  // -1: not sent yet
  for (bool moved = true; moved;) {
    moved = false;
    for (int r = 0; r < pp; ++r) {
      for (; pos[r] < schedule[r].size(); ++pos[r], moved = true) {
        const Action& a = schedule[r][pos[r]];
        const int s = virtual_stage(pp, r, a.chunk);
        if (is_recv(a.type)) {
          double t = -1.0;
          if (dense) {
            t = arrived[size_t(dm.slot(a, r))];
          } else if (auto it = arrival.find(message_of(a, r, pp)); it != arrival.end()) {
            t = it->second;
          }
          if (t < 0) break;
          clock[r] = std::max(clock[r], t);
        } else if (is_send(a.type)) {
          const double t = clock[r] + costs.p2p_latency;  // a doubled send keeps the first
          if (dense) {
            double& slot = arrived[size_t(dm.slot(a, r))];
            if (slot < 0) slot = t;
          } else {
            arrival.emplace(message_of(a, r, pp), t);
          }
        } else {
          const bool fwd = a.type == ActionType::Forward;
          const double c = cost_of(fwd ? costs.forward : costs.backward, s);
          clock[r] += c;
          res.busy[r] += c;
          in_flight[r] += fwd ? 1 : -1;
          res.peak_in_flight[r] = std::max(res.peak_in_flight[r], in_flight[r]);
        }
      }
    }
  }

  if (const std::string stuck = stuck_ranks(schedule, pos, pp); !stuck.empty()) {
    res.deadlock = true;
    res.errors.push_back("deadlock: " + stuck);
  }

  res.finish = clock;
  res.makespan = *std::max_element(clock.begin(), clock.end());
  res.ideal = *std::max_element(res.busy.begin(), res.busy.end());
  res.bubble = res.ideal > 0 ? (res.makespan - res.ideal) / res.ideal : 0.0;
  return res;
}

SimResult simulate(const Schedule& schedule, int pp, int vpp, double forward_cost, double backward_cost,
                   double p2p_latency) {
  return simulate(schedule, pp, vpp, SimCosts{{forward_cost}, {backward_cost}, p2p_latency});
}

}  // namespace mpigpt

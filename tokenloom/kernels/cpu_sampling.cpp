// Top-k and top-p (nucleus) filtering of sampled rows' logits on CPUs, without sorting the
// vocabulary.
//
// Both filters ask where a row's descending order crosses a line: top-k, at the k-th largest
// logit; top-p, at the token whose cumulative probability first reaches p.  Sorting a
// 151,936-token row to find that token is what costs (on a CPU PyTorch's sort of a flat row
// took longer than an int4 decode step; docs/performance.md, "Top-k and top-p without a
// sort", has the figures), and a flat row's nucleus is most of its vocabulary, so no short list of likely tokens holds
// it.  Here each token's value is read as an ordered 32-bit key, and the line is narrowed in
// two rounds of 4,096 buckets: one pass over the row totals each bucket of the keys' top 12
// bits (counts for top-k, probabilities for top-p), a scan from the top finds the bucket where
// the running total reaches the target, and the tokens of that bucket alone are bucketed again
// by their next 12 bits.  Only the tokens sharing the final 24-bit prefix are sorted, and they
// are few.  One more pass masks the row.
//
// The keep rules are the definitions' (runner/sampler.py):
// * top-k keeps every logit >= the k-th largest (ties at the line all stay);
// * top-p keeps a token when the probability of the tokens before it, in descending order,
//   is < p (so the most likely token always stays).  Tokens of equal probability come in
//   index order.  Masses are summed in float64, exact up to its rounding.
// Dropped logits become -inf, in place.
//
// Also here, for logprobs (`logprob_rows`): each row's n largest logits and the rank of a
// target token's, in one pass over the row instead of a log-softmax, a comparison and a topk.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

#include <immintrin.h>

namespace {

constexpr int kBits = 12;
constexpr int64_t kBuckets = int64_t{1} << kBits;
using Token = std::pair<uint32_t, int64_t>;  // (key, index in the row)

// A float's bits as an unsigned key in the float's order (-inf lowest; NaN not expected).
inline uint32_t logit_key(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
// Probabilities are >= 0: their plain bits order them.
inline uint32_t prob_key(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  return u;
}

// float -> double by a conversion that writes its whole register: the scalar one (cvtss2sd)
// keeps the register's upper half, so each token's conversion waited on the previous one's
// (a pass over a row took 4.6x as long).
inline double widen(float v) { return _mm_cvtsd_f64(_mm_cvtps_pd(_mm_set_ss(v))); }

// Bucket totals (32 KB: they stay in L1 while the row streams past) and the candidates of
// one row, allocated once per thread, not per row.
struct Tally {
  std::vector<double> total = std::vector<double>(kBuckets);
  std::vector<Token> cand;
};

// Buckets from the top: the first whose running total, itself included, reaches `target`
// (from `run`, the total above the buckets); `run` becomes the total above it.  The lowest
// bucket with a nonzero total if none does (the last sums falling short by rounding).
int64_t crossing(const Tally& t, double target, double& run) {
  int64_t last = -1;
  double before_last = run;
  for (int64_t b = kBuckets - 1; b >= 0; --b) {
    if (t.total[b] == 0) continue;
    if (run + t.total[b] >= target) return b;
    last = b;
    before_last = run;
    run += t.total[b];
  }
  run = before_last;
  return last;
}

// The row's tokens whose keys share the 24-bit prefix where the running total of `weight`
// (> 0 for every token that can be on the line) from the top reaches `target`, into
// `t.cand`; returns the total of the tokens above them.  `key(i)` and `weight(i)` give token
// i's.  With `short_of_target`, whether all tokens together stay under `target` (then nothing
// else is done).
template <typename Key, typename Weight>
double narrow(int64_t V, Key key, Weight weight, double target, Tally& t, bool* short_of_target = nullptr) {
  std::fill(t.total.begin(), t.total.end(), 0.0);
  for (int64_t i = 0; i < V; ++i) t.total[key(i) >> (32 - kBits)] += weight(i);
  if (short_of_target) {  // `target` above every token's total: reported, nothing narrowed
    double all = 0;
    for (int64_t b = 0; b < kBuckets; ++b) all += t.total[b];
    if ((*short_of_target = all < target)) return all;
  }
  double run = 0;
  const uint32_t b1 = static_cast<uint32_t>(crossing(t, target, run));
  t.cand.clear();
  for (int64_t i = 0; i < V; ++i)
    if ((key(i) >> (32 - kBits)) == b1) t.cand.emplace_back(key(i), i);
  // Round 2, over that bucket's tokens: their next 12 bits.
  auto sub = [](uint32_t k) { return (k >> (32 - 2 * kBits)) & (kBuckets - 1); };
  std::fill(t.total.begin(), t.total.end(), 0.0);
  for (const auto& [k, i] : t.cand) t.total[sub(k)] += weight(i);
  const uint32_t b2 = static_cast<uint32_t>(crossing(t, target, run));
  t.cand.erase(std::remove_if(t.cand.begin(), t.cand.end(), [&](const Token& x) { return sub(x.first) != b2; }),
               t.cand.end());
  return run;
}

// logits[r] < the k-th largest of its row -> -inf, for rows with 0 < k[r] < V.
at::Tensor top_k_mask_(at::Tensor logits, const at::Tensor& k) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "top_k_mask_: contiguous float32 [rows, vocab] logits");
  const int64_t N = logits.size(0), V = logits.size(1);
  const auto kc = k.to(at::kLong).contiguous();
  TORCH_CHECK(kc.numel() == N, "top_k_mask_: one k per row");
  const int64_t* kp = kc.data_ptr<int64_t>();
  float* base = logits.data_ptr<float>();
  at::parallel_for(0, N, 1, [&](int64_t r0, int64_t r1) {
    Tally t;
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t kr = kp[r];
      if (kr <= 0 || kr >= V) continue;
      float* row = base + r * V;
      const double above = narrow(V, [&](int64_t i) { return logit_key(row[i]); }, [](int64_t) { return 1.0; },
                                  static_cast<double>(kr), t);
      auto& cand = t.cand;
      if (cand.empty()) continue;  // only with NaN in the row: left as it is
      // the (k - above)-th largest of the prefix's tokens is the k-th largest of the row
      const auto nth = cand.begin() + (kr - static_cast<int64_t>(above) - 1);
      std::nth_element(cand.begin(), nth, cand.end(), std::greater<Token>());
      const uint32_t line = nth->first;
      const float ninf = -std::numeric_limits<float>::infinity();
      for (int64_t i = 0; i < V; ++i) row[i] = logit_key(row[i]) < line ? ninf : row[i];
    }
  });
  return logits;
}

// Tokens outside each row's nucleus -> -inf, for rows with top_p[r] < 1; `probs` is the
// softmax of the rows' logits (float32, same shape).
at::Tensor top_p_mask_(at::Tensor logits, const at::Tensor& probs, const at::Tensor& top_p) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "top_p_mask_: contiguous float32 [rows, vocab] logits");
  TORCH_CHECK(probs.sizes() == logits.sizes() && probs.scalar_type() == at::kFloat,
              "top_p_mask_: float32 probs shaped like the logits");
  const int64_t N = logits.size(0), V = logits.size(1);
  const auto pc = probs.contiguous();
  const auto tc = top_p.to(at::kDouble).contiguous();
  TORCH_CHECK(tc.numel() == N, "top_p_mask_: one top_p per row");
  const float* pbase = pc.data_ptr<float>();
  const double* tp = tc.data_ptr<double>();
  float* base = logits.data_ptr<float>();
  at::parallel_for(0, N, 1, [&](int64_t r0, int64_t r1) {
    Tally t;
    for (int64_t r = r0; r < r1; ++r) {
      const double p = tp[r];
      if (!(p < 1.0)) continue;
      const float* pr = pbase + r * V;
      bool short_of_p = false;  // the whole row's mass stays under p (rounding): every token stays
      double run = narrow(V, [&](int64_t i) { return prob_key(pr[i]); }, [&](int64_t i) { return widen(pr[i]); },
                          p, t, &short_of_p);
      if (short_of_p) continue;
      auto& cand = t.cand;
      if (cand.empty()) continue;  // only with NaN in the row: left as it is
      std::sort(cand.begin(), cand.end(), [](const Token& x, const Token& y) {
        return x.first != y.first ? x.first > y.first : x.second < y.second;
      });
      // In order: a token stays while the mass before it is < p.  `line` is the smallest kept
      // key; of the tokens with that key, those from index `line_from` on are dropped (-1: none).
      uint32_t line = cand.back().first;
      int64_t line_from = -1;
      for (size_t j = 0; j < cand.size(); ++j) {
        if (run >= p) {
          line = cand[j - 1].first;  // j > 0: the first token of the prefix is kept (run < p)
          line_from = cand[j].first == line ? cand[j].second : -1;
          break;
        }
        run += pr[cand[j].second];
      }
      const float ninf = -std::numeric_limits<float>::infinity();
      float* row = base + r * V;
      const int64_t tie_from = line_from >= 0 ? line_from : V;  // ties at the line dropped from here
      for (int64_t i = 0; i < V; ++i) {  // a select, not a branch: which tokens drop is data
        const uint32_t kk = prob_key(pr[i]);
        row[i] = (kk < line) | ((kk == line) & (i >= tie_from)) ? ninf : row[i];
      }
    }
  });
  return logits;
}

// For each row r: the rank of logit targets[r] (1 + how many are larger) and the row's
// `n` largest logits, largest first (equal ones by index), with their indices.  One pass: a
// token enters the running top n only when it beats the n-th so far.
std::tuple<at::Tensor, at::Tensor, at::Tensor> logprob_rows(const at::Tensor& logits, const at::Tensor& targets,
                                                           int64_t n) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat, "logprob_rows: float32 [rows, vocab] logits");
  const auto lc = logits.contiguous();
  const int64_t N = lc.size(0), V = lc.size(1);
  const auto tc = targets.to(at::kLong).contiguous();
  TORCH_CHECK(tc.numel() == N, "logprob_rows: one target per row");
  TORCH_CHECK(n >= 0 && n <= V, "logprob_rows: n must be in [0, vocab]");
  const int64_t* tp = tc.data_ptr<int64_t>();
  for (int64_t r = 0; r < N; ++r) TORCH_CHECK(tp[r] >= 0 && tp[r] < V, "logprob_rows: target out of the vocabulary");
  auto ranks = at::empty({N}, tc.options());
  auto ids = at::empty({N, n}, tc.options());
  auto vals = at::empty({N, n}, lc.options());
  const float* base = lc.data_ptr<float>();
  int64_t* rp = ranks.data_ptr<int64_t>();
  int64_t* ip = ids.data_ptr<int64_t>();
  float* vp = vals.data_ptr<float>();
  at::parallel_for(0, N, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = base + r * V;
      const float target = row[tp[r]];
      float* top_v = vp + r * n;  // the running top n, sorted: [0, have)
      int64_t* top_i = ip + r * n;
      int64_t have = 0, larger = 0;
      for (int64_t i = 0; i < V; ++i) {
        const float v = row[i];
        larger += v > target;
        if (n == 0 || (have == n && !(v > top_v[n - 1]))) continue;  // not above the n-th so far (NaN never is)
        if (have < n && v != v) continue;                 // NaN does not enter
        int64_t j = have < n ? have++ : n - 1;            // shift the smaller ones down
        for (; j > 0 && top_v[j - 1] < v; --j) {
          top_v[j] = top_v[j - 1];
          top_i[j] = top_i[j - 1];
        }
        top_v[j] = v;
        top_i[j] = i;
      }
      for (int64_t j = have; j < n; ++j) {  // a row of NaN: what it has, then the first indices
        top_v[j] = std::numeric_limits<float>::quiet_NaN();
        top_i[j] = j;
      }
      rp[r] = larger + 1;
    }
  });
  return {ranks, ids, vals};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenloom_cpu, m) {
  m.def("top_k_mask_(Tensor(a!) logits, Tensor k) -> Tensor(a!)");
  m.def("top_p_mask_(Tensor(a!) logits, Tensor probs, Tensor top_p) -> Tensor(a!)");
  m.def("logprob_rows(Tensor logits, Tensor targets, int n) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(tokenloom_cpu, CPU, m) {
  m.impl("top_k_mask_", &top_k_mask_);
  m.impl("top_p_mask_", &top_p_mask_);
  m.impl("logprob_rows", &logprob_rows);
}

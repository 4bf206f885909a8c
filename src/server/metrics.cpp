#include "server/metrics.h"

#include <cstdio>

namespace dflash::server {

namespace {
std::string num(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.9g", v);
  return buf;
}
void count(std::vector<std::pair<std::string, uint64_t>>& counters, const std::string& key) {
  for (auto& [k, n] : counters) {
    if (k == key) {
      ++n;
      return;
    }
  }
  counters.emplace_back(key, 1);
}
void line(std::string& out, const std::string& text) { out += text + "\n"; }
void header(std::string& out, const std::string& name, const std::string& type, const std::string& help) {
  line(out, "# HELP " + name + " " + help);
  line(out, "# TYPE " + name + " " + type);
}
}  // namespace

void Histogram::observe(double v) {
  size_t i = 0;
  while (i < bounds_.size() && v > bounds_[i]) ++i;
  ++counts_[i];
  sum_ += v;
  ++n_;
}

void Histogram::render(const std::string& name, const std::string& help, std::string& out) const {
  header(out, name, "histogram", help);
  uint64_t cum = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) {
    cum += counts_[i];
    line(out, name + "_bucket{le=\"" + num(bounds_[i]) + "\"} " + std::to_string(cum));
  }
  line(out, name + "_bucket{le=\"+Inf\"} " + std::to_string(n_));
  line(out, name + "_sum " + num(sum_));
  line(out, name + "_count " + std::to_string(n_));
}

Metrics::Metrics()
    : ttft_({0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30}),
      tpot_({0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1}) {}

void Metrics::request_finished(const std::string& endpoint, int http_status) {
  std::lock_guard<std::mutex> lk(mu_);
  count(requests_, "endpoint=\"" + endpoint + "\",status=\"" + std::to_string(http_status) + "\"");
}

void Metrics::request_failed(const std::string& endpoint) {
  std::lock_guard<std::mutex> lk(mu_);
  count(failures_, "endpoint=\"" + endpoint + "\"");
}

void Metrics::first_token(double seconds) {
  std::lock_guard<std::mutex> lk(mu_);
  ttft_.observe(seconds);
}

void Metrics::per_output_token(double seconds) {
  std::lock_guard<std::mutex> lk(mu_);
  tpot_.observe(seconds);
}

std::string Metrics::render(const ServingStats& st, const std::string& model) const {
  std::lock_guard<std::mutex> lk(mu_);
  std::string out;
  header(out, "dflash_requests_total", "counter", "HTTP requests by endpoint and status");
  for (const auto& [k, n] : requests_) line(out, "dflash_requests_total{" + k + "} " + std::to_string(n));
  header(out, "dflash_request_failures_total", "counter", "requests the engine failed (answered with an error)");
  for (const auto& [k, n] : failures_) line(out, "dflash_request_failures_total{" + k + "} " + std::to_string(n));
  auto gauge = [&](const std::string& name, const std::string& type, const std::string& help, double v) {
    header(out, name, type, help);
    line(out, name + "{model=\"" + model + "\"} " + num(v));
  };
  gauge("dflash_prompt_tokens_total", "counter", "prompt tokens prefilled (recomputed ones included)",
        static_cast<double>(st.prompt_tokens));
  gauge("dflash_generation_tokens_total", "counter", "tokens generated", static_cast<double>(st.generated_tokens));
  gauge("dflash_engine_steps_total", "counter", "engine steps (one target forward each)", static_cast<double>(st.n_steps));
  gauge("dflash_graph_steps_total", "counter", "engine steps run as CUDA-graph replays",
        static_cast<double>(st.graph_steps));
  gauge("dflash_dflash_steps_total", "counter", "DFlash sequence-steps (one draft block verified)",
        static_cast<double>(st.dflash_seq_steps));
  gauge("dflash_requests_finished_total", "counter", "requests the engine has ended", static_cast<double>(st.n_finished));
  gauge("dflash_preemptions_total", "counter", "sequences preempted for KV pages (recomputed later)",
        static_cast<double>(st.n_preempted));
  gauge("dflash_kv_pages_used", "gauge", "KV-cache pages in use", st.kv_pages_used);
  gauge("dflash_kv_pages_free", "gauge", "KV-cache pages free", st.kv_pages_total - st.kv_pages_used);
  gauge("dflash_kv_pages_cached", "gauge", "free KV pages holding a cached prefix", st.kv_pages_cached);
  gauge("dflash_prefix_cache_hit_pages_total", "counter", "KV pages reused from the prefix cache",
        static_cast<double>(st.prefix_hit_pages));
  gauge("dflash_state_snapshots_total", "counter",
        "recurrent states kept at page ends for the prefix cache (hybrid targets)",
        static_cast<double>(st.state_snapshots_taken));
  gauge("dflash_requests_running", "gauge", "sequences being decoded", st.n_running);
  gauge("dflash_requests_waiting", "gauge", "sequences waiting for admission", st.n_waiting);
  // Acceptance length: tokens produced per DFlash sequence-step (1 = no draft token accepted).
  header(out, "dflash_acceptance_length", "histogram", "tokens produced per DFlash sequence-step");
  uint64_t cum = 0, n = 0;
  double sum = 0;
  for (size_t i = 0; i < st.acceptance_histogram.size(); ++i) {
    cum += st.acceptance_histogram[i];
    sum += static_cast<double>(i + 1) * st.acceptance_histogram[i];
    line(out, "dflash_acceptance_length_bucket{le=\"" + std::to_string(i + 1) + "\"} " + std::to_string(cum));
  }
  n = cum;
  line(out, "dflash_acceptance_length_bucket{le=\"+Inf\"} " + std::to_string(n));
  line(out, "dflash_acceptance_length_sum " + num(sum));
  line(out, "dflash_acceptance_length_count " + std::to_string(n));
  header(out, "dflash_acceptance_rate", "gauge", "fraction of DFlash sequence-steps whose draft token at a position was accepted");
  for (size_t i = 0; i < st.position_accepted.size(); ++i) {
    const double rate = st.dflash_seq_steps ? static_cast<double>(st.position_accepted[i]) / st.dflash_seq_steps : 0.0;
    line(out, "dflash_acceptance_rate{position=\"" + std::to_string(i + 1) + "\"} " + num(rate));
  }
  ttft_.render("dflash_time_to_first_token_seconds", "time from request to first token", out);
  tpot_.render("dflash_time_per_output_token_seconds", "mean time between output tokens of a request", out);
  return out;
}

}  // namespace dflash::server

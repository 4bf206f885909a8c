// Server metrics in the Prometheus text format: request and token counters,
// TTFT and time-per-output-token histograms, and the engine's DFlash and KV
// statistics (read from ServingEngine::stats() at scrape time).
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "engine/serving.h"

namespace dflash::server {

class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}
  void observe(double v);
  // Appends "<name>_bucket{le=...}", "_sum" and "_count" lines.
  void render(const std::string& name, const std::string& help, std::string& out) const;

 private:
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_;  // last: +Inf
  double sum_ = 0;
  uint64_t n_ = 0;
};

class Metrics {
 public:
  Metrics();
  // Once per request, when its response has ended (streams included).
  void request_finished(const std::string& endpoint, int http_status);
  // A request the engine failed (reported to the client as an error).
  void request_failed(const std::string& endpoint);
  void first_token(double seconds);   // time to first token
  void per_output_token(double seconds);
  std::string render(const ServingStats& st, const std::string& model) const;

 private:
  mutable std::mutex mu_;
  std::vector<std::pair<std::string, uint64_t>> requests_;  // "endpoint,status" -> count
  std::vector<std::pair<std::string, uint64_t>> failures_;  // "endpoint" -> count
  Histogram ttft_, tpot_;
};

}  // namespace dflash::server

// A per-kernel GPU profile for machines without Nsight Systems: a CUDA
// injection library (the driver loads it when CUDA_INJECTION64_PATH names it)
// that records every kernel through CUPTI's activity API, graph nodes
// included, and at exit writes a summary to $DFLASH_TRACE_OUT (default
// stderr).
//
// Kernels launched by one cudaGraphLaunch share a correlation id, so each
// graph replay is one group: its span (first start to last end), its busy
// time (sum of kernel durations; a graph here runs on one stream) and the gap
// between them (launch latency and idle SMs between dependent kernels). The
// summary gives, per graph, the median replay and each kernel's share of it.
// With DFLASH_TRACE_TIMELINE set, it also writes every kernel and every CUDA
// runtime or driver call of DFLASH_TRACE_CALL_US (default 100) us or more to
// that file in start order (where the time of one step went: a slow kernel, or
// the host between kernels).
//
//   CUDA_INJECTION64_PATH=libdflash_kernel_trace.so DFLASH_TRACE_OUT=trace.txt dflash bench-step ...
#include <cupti.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cxxabi.h>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace {

struct KernelRecord {
  std::string name;
  uint64_t start, end;
  uint32_t correlation, graph;
};

std::mutex g_mu;
std::vector<KernelRecord> g_records;
std::vector<KernelRecord> g_calls;  // runtime and driver calls of g_call_ns or more (timeline only)
uint64_t g_call_ns = 100000;
size_t g_dropped = 0;

// "void ns::(anonymous namespace)::kernel<4, 2>(args...)" -> "ns::kernel<4, 2>", at most 100 characters.
std::string short_name(const char* mangled) {
  int status = 0;
  char* d = abi::__cxa_demangle(mangled, nullptr, nullptr, &status);
  std::string s = status == 0 && d ? d : mangled;
  std::free(d);
  for (const std::string anon = "(anonymous namespace)::"; s.find(anon) != std::string::npos;)
    s.erase(s.find(anon), anon.size());
  int depth = 0;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '<') ++depth;
    if (s[i] == '>') --depth;
    if (s[i] == '(' && depth == 0) {
      s.resize(i);
      break;
    }
  }
  if (s.rfind("void ", 0) == 0) s.erase(0, 5);
  if (s.size() > 100) s.resize(100);
  return s;
}

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *size = size_t{16} << 20;
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, *size));
  *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  CUpti_Activity* rec = nullptr;
  std::lock_guard<std::mutex> lock(g_mu);
  while (cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
    if (rec->kind == CUPTI_ACTIVITY_KIND_RUNTIME || rec->kind == CUPTI_ACTIVITY_KIND_DRIVER) {
      const auto* a = reinterpret_cast<const CUpti_ActivityAPI*>(rec);
      if (a->end - a->start < g_call_ns) continue;
      const char* name = nullptr;
      cuptiGetCallbackName(rec->kind == CUPTI_ACTIVITY_KIND_RUNTIME ? CUPTI_CB_DOMAIN_RUNTIME_API
                                                                    : CUPTI_CB_DOMAIN_DRIVER_API,
                           a->cbid, &name);
      g_calls.push_back({std::string("call ") + (name ? name : "?"), a->start, a->end, a->correlationId, 0});
      continue;
    }
    if (rec->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) continue;
    const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(rec);
    // The grid tells apart launches of one kernel on different shapes (q/k/v vs o products).
    g_records.push_back({short_name(k->name) + " [" + std::to_string(k->gridX) + "x" + std::to_string(k->gridY) + "x" +
                             std::to_string(k->gridZ) + "]",
                         k->start, k->end, k->correlationId, k->graphId});
  }
  size_t dropped = 0;
  cuptiActivityGetNumDroppedRecords(nullptr, 0, &dropped);
  g_dropped += dropped;
  std::free(buffer);
}

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The first kernels of a replay in start order (one layer's worth shows where a layer's time
// goes): median duration, and median time added to the replay's end (the end minus the latest
// end before it), which stays meaningful when programmatic dependent launch overlaps kernels.
void write_first_nodes(FILE* f, const std::map<uint32_t, std::vector<size_t>>& replays) {
  const char* env = std::getenv("DFLASH_TRACE_NODES");
  const size_t n_nodes = env ? std::strtoul(env, nullptr, 10) : 16;
  std::vector<std::vector<double>> dur(n_nodes), added(n_nodes);
  std::vector<std::string> names(n_nodes);
  for (const auto& [corr, idx] : replays) {
    std::vector<size_t> order = idx;
    std::sort(order.begin(), order.end(), [](size_t a, size_t b) { return g_records[a].start < g_records[b].start; });
    uint64_t last_end = order.empty() ? 0 : g_records[order[0]].start;
    for (size_t j = 0; j < order.size() && j < n_nodes; ++j) {
      const KernelRecord& r = g_records[order[j]];
      dur[j].push_back(static_cast<double>(r.end - r.start) / 1e3);
      added[j].push_back(r.end > last_end ? static_cast<double>(r.end - last_end) / 1e3 : 0.0);
      last_end = std::max(last_end, r.end);
      names[j] = r.name;
    }
  }
  std::fprintf(f, "first kernels of a replay, in start order:\n%6s %10s %10s  %s\n", "node", "dur_us", "added_us",
               "kernel");
  for (size_t j = 0; j < n_nodes && !dur[j].empty(); ++j)
    std::fprintf(f, "%6zu %10.2f %10.2f  %s\n", j, median(dur[j]), median(added[j]), names[j].c_str());
}

// Every kernel and long call in start order, microseconds from the first record.
void write_timeline(const char* path) {
  FILE* f = std::fopen(path, "w");
  if (!f) return;
  std::vector<const KernelRecord*> all;
  for (const auto& r : g_records) all.push_back(&r);
  for (const auto& r : g_calls) all.push_back(&r);
  std::sort(all.begin(), all.end(), [](const auto* a, const auto* b) { return a->start < b->start; });
  const uint64_t t0 = all.empty() ? 0 : all.front()->start;
  std::fprintf(f, "%14s %10s %8s  %s\n", "start_us", "dur_us", "graph", "kernel or call");
  for (const auto* r : all)
    std::fprintf(f, "%14.1f %10.1f %8u  %s\n", static_cast<double>(r->start - t0) / 1e3,
                 static_cast<double>(r->end - r->start) / 1e3, r->graph, r->name.c_str());
  std::fclose(f);
}

void write_summary() {
  cuptiActivityFlushAll(1);
  if (const char* timeline = std::getenv("DFLASH_TRACE_TIMELINE")) {
    std::lock_guard<std::mutex> lock(g_mu);
    write_timeline(timeline);
  }
  const char* path = std::getenv("DFLASH_TRACE_OUT");
  FILE* f = path ? std::fopen(path, "w") : stderr;
  if (!f) f = stderr;
  std::lock_guard<std::mutex> lock(g_mu);
  // Graph id -> replays (correlation id -> record indices).
  std::map<uint32_t, std::map<uint32_t, std::vector<size_t>>> graphs;
  for (size_t i = 0; i < g_records.size(); ++i) graphs[g_records[i].graph][g_records[i].correlation].push_back(i);
  std::fprintf(f, "kernel records: %zu (dropped %zu)\n", g_records.size(), g_dropped);
  for (const auto& [graph, replays] : graphs) {
    if (graph == 0) {
      std::fprintf(f, "\n== kernels outside graphs: %zu launches ==\n", replays.size());
    } else {
      std::vector<double> span, busy;
      size_t kernels = 0;
      for (const auto& [corr, idx] : replays) {
        uint64_t lo = UINT64_MAX, hi = 0;
        double sum = 0;
        for (size_t i : idx) {
          lo = std::min(lo, g_records[i].start);
          hi = std::max(hi, g_records[i].end);
          sum += static_cast<double>(g_records[i].end - g_records[i].start);
        }
        span.push_back(static_cast<double>(hi - lo) / 1e3);
        busy.push_back(sum / 1e3);
        kernels = std::max(kernels, idx.size());
      }
      const double s = median(span), b = median(busy);
      std::fprintf(f, "\n== graph %u: %zu replays, %zu kernels each; median span %.1f us, kernels busy %.1f us, "
                      "gaps %.1f us (%.2f us per kernel boundary) ==\n",
                   graph, replays.size(), kernels, s, b, s - b, kernels > 1 ? (s - b) / (kernels - 1) : 0.0);
    }
    // Per kernel name: launches per replay, mean and total time per replay.
    std::map<std::string, std::pair<size_t, double>> by_name;
    for (const auto& [corr, idx] : replays)
      for (size_t i : idx) {
        auto& e = by_name[g_records[i].name];
        e.first += 1;
        e.second += static_cast<double>(g_records[i].end - g_records[i].start) / 1e3;
      }
    std::vector<std::pair<std::string, std::pair<size_t, double>>> rows(by_name.begin(), by_name.end());
    std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) { return a.second.second > b.second.second; });
    const double n = graph == 0 ? 1.0 : static_cast<double>(replays.size());  // outside graphs: totals
    std::fprintf(f, "%12s %10s %12s  %s\n", "per_replay", "mean_us", "us_per_replay", "kernel");
    for (const auto& [name, e] : rows)
      std::fprintf(f, "%12.1f %10.2f %12.1f  %s\n", static_cast<double>(e.first) / n, e.second / e.first,
                   e.second / n, name.c_str());
    if (graph != 0) write_first_nodes(f, replays);
  }
  if (f != stderr) std::fclose(f);
}

}  // namespace

extern "C" int InitializeInjection() {
  if (cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed) != CUPTI_SUCCESS ||
      cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) != CUPTI_SUCCESS) {
    std::fprintf(stderr, "kernel_trace: CUPTI activity tracing could not be enabled\n");
    return 0;
  }
  if (const char* us = std::getenv("DFLASH_TRACE_CALL_US")) g_call_ns = static_cast<uint64_t>(std::max(0.0, std::atof(us)) * 1e3);
  if (std::getenv("DFLASH_TRACE_TIMELINE") &&
      (cuptiActivityEnable(CUPTI_ACTIVITY_KIND_RUNTIME) != CUPTI_SUCCESS ||
       cuptiActivityEnable(CUPTI_ACTIVITY_KIND_DRIVER) != CUPTI_SUCCESS))
    std::fprintf(stderr, "kernel_trace: CUPTI API tracing could not be enabled; the timeline has kernels only\n");
  std::atexit(write_summary);
  return 1;
}

// `dflash logits`: the target's logits for every prompt position, as raw
// little-endian float32 [n_tokens, vocab], for comparison with other engines.
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>

#include "cli/commands.h"
#include "engine/model_set.h"
#include "model/target_model.h"
#include "util/error.h"

namespace dflash::cli {

Command add_logits(CLI::App& app) {
  struct Args {
    std::string model, out, device = "auto";
    std::vector<int32_t> ids;
  };
  auto a = std::make_shared<Args>();
  app.add_option("--model", a->model, "target checkpoint directory")->required();
  app.add_option("--prompt-ids", a->ids, "token ids, comma-separated")->delimiter(',')->required();
  app.add_option("--out", a->out, "output file (float32, one row of vocab logits per token)")->required();
  app.add_option("--device", a->device, "cpu, cuda or auto")->check(CLI::IsMember({"cpu", "cuda", "auto"}));
  return [a] {
    auto be = make_backend(a->device);
    TargetModel m(*be, a->model);
    const ModelConfig& c = m.config();
    const auto n = static_cast<int64_t>(a->ids.size());
    check(n > 0 && n < c.max_positions, "--prompt-ids: need 1..", c.max_positions - 1, " tokens");
    for (int32_t id : a->ids) check(id >= 0 && id < c.n_vocab, "token id ", id, " is outside the vocabulary");
    const int page_size = 16;
    const int n_pages = static_cast<int>((n + page_size - 1) / page_size);
    KvCache cache = m.alloc_cache(n_pages, page_size);
    std::vector<int32_t> table(static_cast<size_t>(n_pages));
    for (int i = 0; i < n_pages; ++i) table[i] = i;
    ForwardBatch b(page_size);
    b.add_sequence(a->ids, 0, table, true, {0});
    for (int32_t r = 0; r < b.n_rows(); ++r) b.logit_rows.push_back(r);
    const std::vector<float> logits = be->to_host(m.forward(b, cache).logits);
    std::ofstream out(a->out, std::ios::binary);
    check(static_cast<bool>(out), "cannot write ", a->out);
    out.write(reinterpret_cast<const char*>(logits.data()), static_cast<std::streamsize>(logits.size() * sizeof(float)));
    std::printf("%s: %lld x %d float32 logits (%s)\n", a->out.c_str(), static_cast<long long>(n), c.n_vocab,
                be->name().c_str());
    return 0;
  };
}

}  // namespace dflash::cli

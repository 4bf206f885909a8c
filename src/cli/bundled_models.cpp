#include "cli/bundled_models.h"

#include <cstdlib>
#include <filesystem>
#include <vector>

#include "util/error.h"

namespace dflash::cli {

std::string bundled_model_dir(const std::string& name) {
  namespace fs = std::filesystem;
  std::vector<fs::path> roots;
  if (const char* env = std::getenv("DFLASH_MODELS_DIR")) roots.emplace_back(env);
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    roots.push_back(exe.parent_path() / "models");
    roots.push_back(exe.parent_path().parent_path() / "models");
  }
  roots.emplace_back(DFLASH_SOURCE_MODELS_DIR);
  std::string searched;
  for (const fs::path& r : roots) {
    const fs::path dir = r / name;
    if (fs::is_regular_file(dir / "config.json", ec)) return dir.string();
    searched += (searched.empty() ? "" : ", ") + dir.string();
  }
  throw Error(cat("no --model given and the bundled model ", name, " was not found (looked in ", searched, ")"));
}

}  // namespace dflash::cli

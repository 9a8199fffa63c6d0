#include "common/env_flags.h"

#include <gflags/gflags.h>

#include <cstdlib>

namespace tgis {

void NormalizeDashedFlags(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    char* a = argv[i];
    if (a[0] != '-' || a[1] != '-') continue;
    if (a[2] == '\0') break;  // "--": the rest are positional
    for (char* c = a + 2; *c != '\0' && *c != '='; ++c) {
      if (*c == '-') *c = '_';
    }
  }
}

std::string ApplyEnvFallbacks(const std::vector<std::pair<std::string, std::string>>& pairs) {
  for (const auto& [flag, env] : pairs) {
    gflags::CommandLineFlagInfo info;
    if (!gflags::GetCommandLineFlagInfo(flag.c_str(), &info)) {
      return "unknown flag " + flag;
    }
    if (!info.is_default) continue;
    const char* value = std::getenv(env.c_str());
    if (value == nullptr) continue;
    if (gflags::SetCommandLineOption(flag.c_str(), value).empty()) {
      return "invalid value '" + std::string(value) + "' for " + env + " (--" + flag + ")";
    }
  }
  return "";
}

}  // namespace tgis

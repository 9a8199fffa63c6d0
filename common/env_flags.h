// gflags with environment-variable fallbacks, as TGIS has them: a flag left at its default
// takes the value of its environment variable when that is set.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace tgis {

// Rewrites "--some-flag" to "--some_flag" in argv (up to a bare "--"), so that flags can be
// spelled with dashes as TGIS spells them; gflags itself only knows underscores.
void NormalizeDashedFlags(int argc, char** argv);

// For each (flag, ENV_VAR): if the flag was not given on the command line and ENV_VAR is set,
// the flag takes ENV_VAR's value. Returns an error message for a value the flag rejects.
std::string ApplyEnvFallbacks(const std::vector<std::pair<std::string, std::string>>& pairs);

}  // namespace tgis

// text-generation-server's operator commands, as TGIS's CLI has them:
//   download-weights MODEL_NAME [--revision R] [--token T] [--extension .safetensors]
//                    [--auto-convert | --no-auto-convert]
//   convert-to-safetensors MODEL_NAME [--revision R]
// MODEL_NAME is a hub id (the local cache per HF_HUB_CACHE/HF_HOME) or a local folder.
#pragma once

namespace tgis::server {

// `argv[1]` is the command's name. Returns the process exit code.
int RunDownloadWeights(int argc, char** argv);
int RunConvertToSafetensors(int argc, char** argv);

}  // namespace tgis::server

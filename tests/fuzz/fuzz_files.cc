#include "tests/fuzz/fuzz_files.h"

#include <glog/logging.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace tgis::fuzz {

namespace fs = std::filesystem;

const std::string& ScratchDir() {
  // Never destroyed: the exit handler that removes the folder runs after static destructors.
  static const std::string* dir = [] {
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern = std::string(tmp != nullptr && *tmp ? tmp : "/tmp") + "/tgis-fuzz-XXXXXX";
    if (mkdtemp(pattern.data()) == nullptr) std::abort();
    auto* path = new std::string(pattern);
    std::atexit([] {
      std::error_code ec;
      fs::remove_all(ScratchDir(), ec);
    });
    return path;
  }();
  return *dir;
}

std::string WriteScratch(const std::string& name, const uint8_t* data, size_t size) {
  const std::string path = ScratchDir() + "/" + name;
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  return path;
}

std::string WriteScratch(const std::string& name, const std::string& text) {
  return WriteScratch(name, reinterpret_cast<const uint8_t*>(text.data()), text.size());
}

void QuietLogs() { FLAGS_minloglevel = google::GLOG_ERROR; }

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream buf;
  buf << in.rdbuf();
  return buf.str();
}

std::string CopyFixture(const std::string& fixture, const std::string& name) {
  return WriteScratch(name, ReadFile(std::string(TGIS_FIXTURES_DIR) + "/" + fixture));
}

}  // namespace tgis::fuzz

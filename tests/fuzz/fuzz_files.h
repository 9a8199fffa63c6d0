// Files for fuzz targets whose code under test reads a folder (tokenizers, configs, TLS): one
// scratch folder per process, removed at exit.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace tgis::fuzz {

// The scratch folder (created on first use under $TMPDIR or /tmp).
const std::string& ScratchDir();
// Writes `size` bytes to ScratchDir()/name and returns the file's path.
std::string WriteScratch(const std::string& name, const uint8_t* data, size_t size);
std::string WriteScratch(const std::string& name, const std::string& text);
// Copies a fixture file (relative to tests/fixtures) into the scratch folder as `name`.
std::string CopyFixture(const std::string& fixture, const std::string& name);
// Logs below ERROR off: the code under test logs what it loads, once per input.
void QuietLogs();
// The whole of a file (empty if unreadable).
std::string ReadFile(const std::string& path);

}  // namespace tgis::fuzz

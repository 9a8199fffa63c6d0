// Progress lines: what they say (files, bytes of the total, rate, ETA) and how often.
#include "common/progress.h"

#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <vector>

namespace {

using tgis::Progress;

TEST(ProgressTest, LineSaysFilesBytesShareRateAndEta) {
  std::vector<std::string> lines;
  Progress p(
      "download org/m", 4 << 20, 4, [&](const std::string& l) { lines.push_back(l); },
      std::chrono::hours(1));
  p.AddBytes(1 << 20);
  p.FileDone();
  const std::string line = p.Line();
  EXPECT_EQ(line.rfind("download org/m: 1/4 files, 1.00 MiB of 4.00 MiB (25%), ", 0), 0u) << line;
  EXPECT_NE(line.find("/s, ETA "), std::string::npos) << line;
  EXPECT_TRUE(lines.empty());  // within the interval nothing is printed
}

TEST(ProgressTest, AtMostOneLinePerIntervalAndOneClosingLine) {
  std::vector<std::string> lines;
  {
    Progress p(
        "load", 100, 0, [&](const std::string& l) { lines.push_back(l); },
        std::chrono::milliseconds(0));
    p.AddBytes(50);
    p.AddBytes(50);
    p.Finish();
    p.Finish();
    p.AddBytes(1);
  }
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_EQ(lines[0].rfind("load: 50 B of 100 B (50%)", 0), 0u) << lines[0];
  EXPECT_EQ(lines[2].rfind("load: done, 100 B in ", 0), 0u) << lines[2];
  Progress quiet(
      "q", 0, 0, [&](const std::string& l) { lines.push_back(l); }, std::chrono::hours(1));
  for (int i = 0; i < 1000; ++i) quiet.AddBytes(1);
  EXPECT_EQ(lines.size(), 3u);
}

TEST(ProgressTest, FormatsBytesInBinaryUnits) {
  EXPECT_EQ(Progress::FormatBytes(512), "512 B");
  EXPECT_EQ(Progress::FormatBytes(1536), "1.50 KiB");
  EXPECT_EQ(Progress::FormatBytes(16.0 * (1 << 30)), "16.0 GiB");
}

}  // namespace

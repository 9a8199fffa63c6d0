// The stop-sequence matcher: matches across token boundaries, include/exclude, held-back text
// (router/stop_sequences.h).
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "router/stop_sequences.h"

namespace tgis::router {
namespace {

struct Fed {
  std::vector<std::string> released;  // per piece
  std::string text;                   // all released text
  std::optional<size_t> match;
};

// Feeds the pieces (all allowed to stop), flushing at the end unless a stop sequence matched.
Fed Feed(StopSequenceMatcher& m, const std::vector<std::string>& pieces) {
  Fed fed;
  for (const std::string& p : pieces) {
    StopSequenceMatcher::Result r = m.Append(p, /*may_stop=*/true);
    fed.released.push_back(r.released);
    fed.text += r.released;
    if (r.match) {
      fed.match = r.match;
      return fed;
    }
  }
  fed.text += m.Flush();
  return fed;
}

TEST(StopSequenceMatcher, NoStopSequencesPassesTextThrough) {
  StopSequenceMatcher m({}, true);
  Fed f = Feed(m, {"Hello", " wor", "ld"});
  EXPECT_EQ(f.released, (std::vector<std::string>{"Hello", " wor", "ld"}));
  EXPECT_FALSE(f.match);
}

TEST(StopSequenceMatcher, IncludedAcrossTokensNothingHeldBack) {
  StopSequenceMatcher m({"Pari"}, /*include_stop_sequence=*/true);
  Fed f = Feed(m, {"The capital is P", "aris", " and more"});
  ASSERT_TRUE(f.match);
  EXPECT_EQ(*f.match, 0u);
  // "P" goes out at once (an included stop sequence may be streamed piecewise); the text after
  // the sequence is cut.
  EXPECT_EQ(f.released, (std::vector<std::string>{"The capital is P", "ari"}));
  EXPECT_EQ(f.text, "The capital is Pari");
  EXPECT_TRUE(m.matched());
  EXPECT_EQ(m.Append("more", true).released, "");
}

TEST(StopSequenceMatcher, ExcludedIsHeldBackUntilDecided) {
  StopSequenceMatcher m({"Pari"}, /*include_stop_sequence=*/false);
  Fed f = Feed(m, {"The capital is P", "ar", "is"});
  ASSERT_TRUE(f.match);
  EXPECT_EQ(f.released, (std::vector<std::string>{"The capital is ", "", ""}));
  EXPECT_EQ(f.text, "The capital is ");
}

TEST(StopSequenceMatcher, HeldBackTextIsReleasedWhenItTurnsOutNotToMatch) {
  StopSequenceMatcher m({"Pari"}, false);
  Fed f = Feed(m, {"P", "ar", "ty", " time P"});
  EXPECT_FALSE(f.match);
  EXPECT_EQ(f.released, (std::vector<std::string>{"", "", "Party", " time "}));
  EXPECT_EQ(f.text, "Party time P");  // the flush releases the last "P"
}

TEST(StopSequenceMatcher, MatchInsideOnePiece) {
  StopSequenceMatcher m({"stop"}, false);
  Fed f = Feed(m, {"go on and stop here"});
  ASSERT_TRUE(f.match);
  EXPECT_EQ(f.text, "go on and ");

  StopSequenceMatcher inc({"stop"}, true);
  EXPECT_EQ(Feed(inc, {"go on and stop here"}).text, "go on and stop");
}

// TGIS's matches_stop_sequence: the first sequence in the request's order that ends in the new
// text, at its last occurrence there.
TEST(StopSequenceMatcher, FirstInRequestOrderWinsAtItsLastOccurrence) {
  StopSequenceMatcher m({"abc", "b", "ab"}, true);
  Fed f = Feed(m, {"xxabcb"});
  ASSERT_TRUE(f.match);
  EXPECT_EQ(*f.match, 0u);  // "abc" is listed first, although "ab" starts as early
  EXPECT_EQ(f.text, "xxabc");

  StopSequenceMatcher last({"b", "abc"}, false);
  f = Feed(last, {"xxabcb"});
  ASSERT_TRUE(f.match);
  EXPECT_EQ(*f.match, 0u);
  EXPECT_EQ(f.text, "xxabc");  // cut at the last "b" of the new text, not the first
}

TEST(StopSequenceMatcher, NoMatchWhileNotAllowedAndNoLateMatch) {
  // Before min_new_tokens a full occurrence is not a stop; it cannot match later either, since
  // a stop sequence must end in the newest text.
  StopSequenceMatcher m({"ab"}, false);
  StopSequenceMatcher::Result r = m.Append("xab", /*may_stop=*/false);
  EXPECT_FALSE(r.match);
  EXPECT_EQ(r.released, "xab");
  r = m.Append("c", true);
  EXPECT_FALSE(r.match);
  EXPECT_EQ(r.released, "c");
  // But a partial one from that time may complete now.
  r = m.Append("a", false);
  EXPECT_EQ(r.released, "");
  r = m.Append("b", true);
  EXPECT_TRUE(r.match);
  EXPECT_EQ(r.released, "");
}

TEST(StopSequenceMatcher, MultibyteAcrossPieces) {
  // An emoji split across byte pieces, as byte-fallback tokens produce it.
  const std::string robot = "\xF0\x9F\xA4\x96";
  StopSequenceMatcher m({robot + " \nTran"}, true);
  Fed f = Feed(m, {"Star Wars: ", "\xF0\x9F", "\xA4\x96 ", "\nTr", "ansformers"});
  ASSERT_TRUE(f.match);
  EXPECT_EQ(f.text, "Star Wars: " + robot + " \nTran");
}

TEST(StopSequenceMatcher, LongStopSequenceExcluded) {
  StopSequenceMatcher m({"w the movie, I was"}, false);
  Fed f = Feed(m, {"The", " first", " time", " I", " saw", " the", " movie", ",", " I", " was"});
  ASSERT_TRUE(f.match);
  EXPECT_EQ(f.text, "The first time I sa");
}

TEST(StopSequenceMatcher, FlushAfterNoMatch) {
  StopSequenceMatcher m({"abc"}, false);
  EXPECT_EQ(m.Append("xxab", true).released, "xx");
  EXPECT_EQ(m.Flush(), "ab");
}

// Reference semantics, on whole strings, as TGIS's batcher.rs matches_stop_sequence: after each
// piece, the first stop sequence in the request's order whose last occurrence ends inside that
// piece stops the text there.
std::string Reference(const std::vector<std::string>& stops, bool include,
                      const std::vector<std::string>& pieces) {
  std::string text;
  for (const std::string& p : pieces) {
    const size_t next_off = text.size() + 1;
    text += p;
    for (const std::string& s : stops) {
      const size_t start = next_off > s.size() ? next_off - s.size() : 0;
      for (size_t pos = text.size() >= s.size() ? text.size() - s.size() + 1 : 0; pos-- > start;) {
        if (text.compare(pos, s.size(), s) == 0) {
          return text.substr(0, include ? pos + s.size() : pos);
        }
      }
    }
  }
  return text;
}

TEST(StopSequenceMatcher, MatchesReferenceOnRandomText) {
  std::mt19937 rng(7);
  const std::string alphabet = "abc";
  auto random_string = [&](size_t max_len) {
    std::string s(1 + rng() % max_len, 'a');
    for (char& c : s) c = alphabet[rng() % alphabet.size()];
    return s;
  };
  for (int trial = 0; trial < 3000; ++trial) {
    std::vector<std::string> stops;
    for (size_t i = 0, n = 1 + rng() % 3; i < n; ++i) stops.push_back(random_string(4));
    std::vector<std::string> pieces;
    for (size_t i = 0, n = 1 + rng() % 8; i < n; ++i) pieces.push_back(random_string(3));
    const bool include = rng() % 2 == 0;
    StopSequenceMatcher m(stops, include);
    Fed f = Feed(m, pieces);
    ASSERT_EQ(f.text, Reference(stops, include, pieces)) << "trial " << trial;
    if (!include) {
      // What was released never contains an excluded stop sequence's beginning that later
      // matched: released text only grows, and the final text is a prefix of the input.
      std::string all;
      for (const std::string& p : pieces) all += p;
      ASSERT_EQ(all.compare(0, f.text.size(), f.text), 0);
    }
  }
}

}  // namespace
}  // namespace tgis::router

// Guided decoding's automata against Python's `re` (tests/fixtures/make_guided_fixtures.py):
// every case's texts match here exactly when re.fullmatch matches them.
#include "grammar/grammar.h"

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "gtest/gtest.h"

namespace {

using tgis::grammar::ByteDfa;
using tgis::grammar::CompileChoices;
using tgis::grammar::CompileRegex;

// tests/fixtures/guided/<name>, made by make_guided_fixtures.py (ordered: a schema's
// properties keep the order they were written in).
nlohmann::ordered_json Fixture(const std::string& name) {
  std::ifstream in(std::string(TGIS_FIXTURES_DIR) + "/guided/" + name);
  std::stringstream buf;
  buf << in.rdbuf();
  return nlohmann::ordered_json::parse(buf.str());
}

nlohmann::ordered_json Cases() { return Fixture("regex_cases.json"); }

TEST(GuidedRegex, MatchesWhatPythonMatches) {
  const nlohmann::ordered_json cases = Cases();
  size_t checked = 0;
  for (const auto& c : cases["cases"]) {
    const std::string pattern = c["pattern"];
    auto dfa = CompileRegex(pattern);
    if (!c["supported"].get<bool>()) {
      EXPECT_FALSE(dfa.ok()) << pattern;
      continue;
    }
    ASSERT_TRUE(dfa.ok()) << pattern << ": " << dfa.status();
    for (const auto& row : c["texts"]) {
      const std::string text = row[0];
      const bool expected = row[1];
      EXPECT_EQ(dfa->Matches(text), expected) << "pattern " << pattern << " text '" << text << "'";
      // A text that matches never passes through a state the automaton has cut.
      if (expected) {
        int32_t s = 0;
        for (char b : text) {
          s = dfa->Step(s, static_cast<uint8_t>(b));
          ASSERT_NE(s, ByteDfa::kDead) << pattern << " / " << text;
        }
      }
      ++checked;
    }
  }
  EXPECT_GT(checked, 5000u);
}

TEST(GuidedRegex, RefusesWhatPythonRefuses) {
  const nlohmann::ordered_json cases = Cases();  // alive for the loop (not a temporary's member)
  for (const auto& p : cases["python_errors"]) {
    auto dfa = CompileRegex(p.get<std::string>());
    EXPECT_FALSE(dfa.ok()) << p;
    EXPECT_NE(dfa.status().message().find("position"), std::string::npos) << dfa.status();
  }
}

TEST(GuidedRegex, RefusesWhatIsNotRegularByName) {
  const nlohmann::ordered_json cases = Cases();
  for (const auto& p : cases["unsupported"]) {
    auto dfa = CompileRegex(p.get<std::string>());
    ASSERT_FALSE(dfa.ok()) << p;
    EXPECT_NE(dfa.status().message().find("cannot be used in guided decoding"), std::string::npos)
        << p << ": " << dfa.status();
  }
}

TEST(GuidedRegex, EveryStateCanStillMatch) {
  // A walk that has not fallen off can always be completed: states that cannot reach an
  // accepting one are cut, so a token is never allowed into a dead end.
  auto dfa = CompileRegex("a(b|c[^\\x00-\\U0010FFFF])d");
  ASSERT_TRUE(dfa.ok()) << dfa.status();
  EXPECT_EQ(dfa->Walk(0, "ac"), ByteDfa::kDead);
  EXPECT_TRUE(dfa->Matches("abd"));
  EXPECT_FALSE(CompileRegex("[^\\x00-\\U0010FFFF]").ok());
}

TEST(GuidedRegex, AcceptsValidUtf8Only) {
  auto any = CompileRegex(".");
  ASSERT_TRUE(any.ok());
  for (const char* valid :
       {"\x7f", "\xc2\x80", "\xdf\xbf", "\xe0\xa0\x80", "\xed\x9f\xbf", "\xee\x80\x80",
        "\xef\xbf\xbf", "\xf0\x90\x80\x80", "\xf4\x8f\xbf\xbf"}) {
    EXPECT_TRUE(any->Matches(valid)) << valid;
  }
  for (const char* invalid : {"\xc0\x80", "\xc1\xbf", "\xe0\x9f\xbf", "\xed\xa0\x80",
                              "\xf0\x8f\xbf\xbf", "\xf4\x90\x80\x80", "\x80", "\xff", "\n"}) {
    EXPECT_FALSE(any->Matches(invalid)) << invalid;
  }
}

TEST(GuidedRegex, RefusesAutomataTooLargeToServe) {
  // The n-th symbol from the end: 2^n states when determinized.
  auto dfa = CompileRegex("(a|b)*a(a|b){20}");
  ASSERT_FALSE(dfa.ok());
  EXPECT_NE(dfa.status().message().find("too complex"), std::string::npos) << dfa.status();
  EXPECT_FALSE(CompileRegex("(a{1000}){1000}").ok());
}

TEST(GuidedRegex, BoundsWhatOneRequestCanCost) {
  // Nesting past the parser's bound is refused (not a stack overflow).
  auto deep = CompileRegex(std::string(100000, '(') + "a" + std::string(100000, ')'));
  ASSERT_FALSE(deep.ok());
  EXPECT_NE(deep.status().message().find("nested too deeply"), std::string::npos);
  // A long chain takes Moore's refinement as many rounds as states: past its budget the
  // automaton is served unminimized, the same language.
  auto chain = CompileRegex("a{10000}");
  ASSERT_TRUE(chain.ok()) << chain.status();
  EXPECT_TRUE(chain->Matches(std::string(10000, 'a')));
  EXPECT_FALSE(chain->Matches(std::string(9999, 'a')));
  EXPECT_FALSE(chain->Matches(std::string(10001, 'a')));
  EXPECT_FALSE(CompileRegex("((a{100}){100}){100}").ok());
  // Counts past 10000 (each copy is expanded) are refused where they are written.
  auto count = CompileRegex("ab{10001}");
  ASSERT_FALSE(count.ok());
  EXPECT_NE(count.status().message().find("a repeat count above 10000 at position 3"),
            std::string::npos)
      << count.status();
  EXPECT_FALSE(CompileRegex("a{2,99999999999999999999}").ok());  // saturates, then refused
}

TEST(GuidedChoices, MatchExactlyTheChoices) {
  auto dfa = CompileChoices({"yes", "no", "yes sir", "日本"});
  ASSERT_TRUE(dfa.ok()) << dfa.status();
  for (const char* t : {"yes", "no", "yes sir", "日本"}) EXPECT_TRUE(dfa->Matches(t)) << t;
  for (const char* t : {"", "ye", "yes ", "nope", "yes sirs", "日"}) {
    EXPECT_FALSE(dfa->Matches(t)) << t;
  }
  // Special characters of regular expressions are plain text in choices.
  auto special = CompileChoices({"a.b", "(c)"});
  ASSERT_TRUE(special.ok());
  EXPECT_TRUE(special->Matches("a.b"));
  EXPECT_FALSE(special->Matches("axb"));
  EXPECT_TRUE(special->Matches("(c)"));
  EXPECT_FALSE(CompileChoices({"\xff"}).ok());
}

TEST(GuidedDfa, ValidateCatchesBrokenTables) {
  auto dfa = CompileRegex("ab*");
  ASSERT_TRUE(dfa.ok());
  EXPECT_TRUE(dfa->Validate().ok());
  ByteDfa broken = *dfa;
  broken.next[0] = 99;
  EXPECT_FALSE(broken.Validate().ok());
  broken = *dfa;
  broken.next.pop_back();
  EXPECT_FALSE(broken.Validate().ok());
  broken = *dfa;
  broken.byte_class[7] = 200;
  EXPECT_FALSE(broken.Validate().ok());
}

}  // namespace

namespace {

nlohmann::ordered_json JsonCases() { return Fixture("json_schema_cases.json"); }

TEST(GuidedJsonSchema, AcceptsWhatJsonschemaValidates) {
  size_t checked = 0;
  const nlohmann::ordered_json cases = JsonCases();
  for (const auto& c : cases["cases"]) {
    const std::string schema = c["schema"].dump();
    auto dfa = tgis::grammar::CompileJsonSchema(schema);
    ASSERT_TRUE(dfa.ok()) << schema << ": " << dfa.status();
    for (const auto& row : c["texts"]) {
      EXPECT_EQ(dfa->Matches(row[0].get<std::string>()), row[1].get<bool>())
          << "schema " << schema << " text " << row[0];
      ++checked;
    }
  }
  EXPECT_GT(checked, 1000u);
}

TEST(GuidedJsonSchema, KeepsThePropertiesOrder) {
  // nlohmann's default object sorts keys; the schema's order is what is generated.
  auto dfa = tgis::grammar::CompileJsonSchema(
      R"({"type":"object","properties":{"z":{"type":"integer"},"a":{"type":"integer"}},)"
      R"("required":["z","a"]})");
  ASSERT_TRUE(dfa.ok()) << dfa.status();
  EXPECT_TRUE(dfa->Matches(R"({"z":1,"a":2})"));
  EXPECT_FALSE(dfa->Matches(R"({"a":2,"z":1})"));
}

TEST(GuidedJsonSchema, RefusesWhatItDoesNotEnforceByName) {
  const auto cases = JsonCases();
  for (const auto& schema : cases["refused"]) {
    auto dfa = tgis::grammar::CompileJsonSchema(schema.dump());
    ASSERT_FALSE(dfa.ok()) << schema;
    EXPECT_EQ(dfa.status().code(), absl::StatusCode::kUnimplemented) << dfa.status();
    EXPECT_NE(dfa.status().message().find("json_schema at #"), std::string::npos) << dfa.status();
  }
  for (const auto& schema : cases["invalid"]) {
    const std::string text = schema.is_string() ? schema.get<std::string>() : schema.dump();
    auto dfa = tgis::grammar::CompileJsonSchema(text);
    ASSERT_FALSE(dfa.ok()) << text;
    EXPECT_EQ(dfa.status().code(), absl::StatusCode::kInvalidArgument) << dfa.status();
  }
}

TEST(GuidedJsonSchema, DeepDocumentsAreRefusedNotRecursedInto) {
  // Deeper than any schema: refused before any part is copied or converted (a recursion).
  for (const std::string& deep :
       {R"({"const":)" + std::string(100000, '[') + std::string(100000, ']') + "}",
        R"({"type":"object","properties":{"a":)" + std::string(100000, '[') +
            std::string(100000, ']') + "}}"}) {
    auto dfa = tgis::grammar::CompileJsonSchema(deep);
    ASSERT_FALSE(dfa.ok());
    EXPECT_EQ(dfa.status().code(), absl::StatusCode::kInvalidArgument) << dfa.status();
  }
  // A constant deeper than its own bound in a document that is not.
  auto dfa = tgis::grammar::CompileJsonSchema(R"({"const":)" + std::string(100, '[') +
                                              std::string(100, ']') + "}");
  ASSERT_FALSE(dfa.ok());
  EXPECT_EQ(dfa.status().code(), absl::StatusCode::kUnimplemented) << dfa.status();
  std::string nested;
  for (int i = 0; i < 1000; ++i) nested += R"({"type":"array","items":)";
  nested += "{}" + std::string(1000, '}');
  EXPECT_FALSE(tgis::grammar::CompileJsonSchema(nested).ok());
}

TEST(GuidedJsonSchema, FormatJsonIsAnyObjectNestedAFewLevels) {
  auto dfa = tgis::grammar::CompileJsonObject();
  ASSERT_TRUE(dfa.ok()) << dfa.status();
  for (const char* t : {"{}", R"({"a":1})", R"({ "a": [1, {"b": null}], "c": "d\n" })",
                        R"({"a":{"b":{"c":{}}}})"}) {
    EXPECT_TRUE(dfa->Matches(t)) << t;
  }
  for (const char* t : {"[]", "1", R"("a")", R"({"a":})", R"({"a":1,})", R"({a:1})",
                        R"({"a":{"b":{"c":{"d":{}}}}})"}) {
    EXPECT_FALSE(dfa->Matches(t)) << t;
  }
}

}  // namespace

namespace {

TEST(GuidedGbnf, MatchesWhatPythonMatchesForTheSameLanguage) {
  const nlohmann::ordered_json cases = Fixture("gbnf_cases.json");
  size_t checked = 0;
  for (const auto& c : cases["cases"]) {
    const std::string grammar = c["grammar"];
    auto dfa = tgis::grammar::CompileGbnf(grammar);
    ASSERT_TRUE(dfa.ok()) << grammar << ": " << dfa.status();
    for (const auto& row : c["texts"]) {
      EXPECT_EQ(dfa->Matches(row[0].get<std::string>()), row[1].get<bool>())
          << "grammar " << grammar << " text " << row[0];
      ++checked;
    }
  }
  EXPECT_GT(checked, 1000u);
  for (const auto& r : cases["refused"]) {
    auto dfa = tgis::grammar::CompileGbnf(r[1].get<std::string>());
    ASSERT_FALSE(dfa.ok()) << r[1];
    EXPECT_EQ(dfa.status().code(), r[0] == "recursive" ? absl::StatusCode::kUnimplemented
                                                       : absl::StatusCode::kInvalidArgument)
        << dfa.status();
    EXPECT_EQ(dfa.status().message().rfind("grammar: ", 0), 0u) << dfa.status();
  }
}

TEST(GuidedGbnf, BoundsWhatOneRequestCanCost) {
  // Deep parentheses and long chains of rules are refused, not a stack overflow.
  auto deep = tgis::grammar::CompileGbnf("root ::= " + std::string(100000, '(') + "\"a\"" +
                                         std::string(100000, ')'));
  ASSERT_FALSE(deep.ok());
  EXPECT_NE(deep.status().message().find("nested too deeply"), std::string::npos);
  std::string chain = "root ::= r0\n";
  for (int i = 0; i < 100000; ++i)
    chain += "r" + std::to_string(i) + " ::= r" + std::to_string(i + 1) + "\n";
  chain += "r100000 ::= \"x\"\n";
  auto long_chain = tgis::grammar::CompileGbnf(chain);
  ASSERT_FALSE(long_chain.ok());
  EXPECT_NE(long_chain.status().message().find("more than 500 deep"), std::string::npos);
  // Parentheses within their bound in each of a chain of rules within its bound: the depth
  // they add up to is bounded too.
  std::string stacked = "root ::= p0\n";
  for (int i = 0; i < 400; ++i) {
    std::string open;
    for (int k = 0; k < 150; ++k) open += "(\"a\" ";
    stacked += "p" + std::to_string(i) + " ::= " + open + "p" + std::to_string(i + 1) +
               std::string(150, ')') + "\n";
  }
  stacked += "p400 ::= \"x\"\n";
  auto stacked_dfa = tgis::grammar::CompileGbnf(stacked);
  ASSERT_FALSE(stacked_dfa.ok());
  EXPECT_NE(stacked_dfa.status().message().find("nested more than 1000"), std::string::npos)
      << stacked_dfa.status();
  // Copies that double at every rule stop at the expansion's bound.
  std::string doubling = "root ::= d0\n";
  for (int i = 0; i < 40; ++i) {
    doubling += "d" + std::to_string(i) + " ::= d" + std::to_string(i + 1) + " d" +
                std::to_string(i + 1) + "\n";
  }
  doubling += "d40 ::= \"x\"\n";
  EXPECT_FALSE(tgis::grammar::CompileGbnf(doubling).ok());
  auto count = tgis::grammar::CompileGbnf("root ::= \"a\"{ 3 , 10001 }");
  ASSERT_FALSE(count.ok());
  EXPECT_NE(count.status().message().find("a repetition count above 10000"), std::string::npos)
      << count.status();
  EXPECT_TRUE(tgis::grammar::CompileGbnf("root ::= \"a\"{ 3 , 10000 }").ok());
}

TEST(GuidedGbnf, ErrorsNameTheLineAndColumn) {
  auto dfa = tgis::grammar::CompileGbnf("root ::= a\na ::= \"x\" )");
  ASSERT_FALSE(dfa.ok());
  EXPECT_EQ(std::string(dfa.status().message()),
            "grammar: expected the end of the rule at line 2 column 11");
  auto recursive = tgis::grammar::CompileGbnf("root ::= \"(\" root \")\" | \"x\"");
  EXPECT_EQ(std::string(recursive.status().message()),
            "grammar: rule root is recursive other than at its end; only grammars of regular "
            "languages are served");
}

}  // namespace

// Template engine behaviour that the jinja2 parity run does not cover: errors
// at load for unsupported constructs, limits, and render-time failures.
#include <gtest/gtest.h>

#include "formats/chat_template.h"
#include "formats/jinja/template.h"
#include "util/error.h"

namespace dflash {
namespace {

using jinja::Template;
using jinja::Value;

std::string render(const std::string& src, const jinja::RenderLimits& limits = {}) {
  return Template(src).render({{"name", Value("Ada")}, {"items", Value(jinja::List{Value(1), Value(2)})}}, limits);
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Jinja, RendersBasicsWithHuggingFaceWhitespaceRules) {
  EXPECT_EQ(render("Hello {{ name }}!"), "Hello Ada!");
  EXPECT_EQ(render("{% for i in items %}\n  {% if i > 1 %}\n[{{ i }}]\n  {% endif %}\n{% endfor %}\n"), "[2]\n");
  EXPECT_EQ(render("a  {%- if true -%}  b  {%- endif -%}  c"), "abc");
  EXPECT_EQ(render("{{ 'x' | tojson }} {{ {'k': 'é\"'} | tojson }}"), "\"x\" {\"k\": \"é\\\"\"}");
}

TEST(Jinja, UnsupportedConstructsFailAtLoad) {
  for (const char* src : {"{% include 'x' %}", "{% extends 'x' %}", "{% import 'x' as y %}", "{{ x | nosuchfilter }}",
                          "{% if x is nosuchtest %}{% endif %}", "{% for x in y recursive %}{% endfor %}",
                          "{% if x %}", "{{ x ", "{% endif %}", "{{ 'unterminated }}", "{# open comment",
                          "{% raw %} never closed", "{{ f(*args) }}", "{{ (1] }}"}) {
    const std::string e = error_of([&] { Template t(src); });
    EXPECT_NE(e, "") << src;
    EXPECT_NE(e.find("template line"), std::string::npos) << src << ": " << e;
  }
}

TEST(Jinja, RenderErrorsNameTheProblem) {
  EXPECT_NE(error_of([] { render("{{ raise_exception('bad role') }}"); }).find("bad role"), std::string::npos);
  EXPECT_NE(error_of([] { render("{{ missing.attr }}"); }).find("'missing' is undefined"), std::string::npos);
  EXPECT_NE(error_of([] { render("{{ 1 + 'a' }}"); }).find("unsupported operand"), std::string::npos);
  EXPECT_NE(error_of([] { render("{{ 1 // 0 }}"); }).find("division"), std::string::npos);
  EXPECT_NE(error_of([] { render("{{ items.append(3) }}"); }).find("not allowed"), std::string::npos);
  EXPECT_NE(error_of([] { render("{{ 9223372036854775807 + 1 }}"); }).find("overflow"), std::string::npos);
}

TEST(Jinja, LimitsStopRunawayTemplates) {
  jinja::RenderLimits small;
  small.max_steps = 10000;
  EXPECT_NE(error_of([&] { render("{% for i in range(100000) %}{{ i }}{% endfor %}", small); }).find("steps"),
            std::string::npos);
  EXPECT_NE(error_of([] { render("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}"); }).find("deeper"),
            std::string::npos);
  jinja::RenderLimits out;
  out.max_output = 1000;
  EXPECT_NE(error_of([&] { render("{{ 'x' * 100000 }}", out); }).find("larger than"), std::string::npos);
  const std::string deep = std::string(5000, '(') + "1" + std::string(5000, ')');
  EXPECT_NE(error_of([&] { Template t("{{ " + deep + " }}"); }).find("deeper"), std::string::npos);
  EXPECT_NE(error_of([&] { Template t("{{ (1] }}"); }).find("unexpected ']'"), std::string::npos);
  EXPECT_NE(error_of([&] { Template t("ok \xC3("); }).find("not valid UTF-8"), std::string::npos);
  // A well-behaved template is unaffected.
  EXPECT_EQ(render("{% for i in range(3) %}{{ i }}{% endfor %}", small), "012");
}

TEST(Jinja, ChatTemplateUsesTokenizerConfig) {
  nlohmann::ordered_json special = {{"bos_token", "<s>"}, {"eos_token", "</s>"}};
  ChatTemplate t("{{ bos_token }}{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}"
                 "{% if tools is none %}no tools{% endif %}{% if add_generation_prompt %}>{% endif %}{{ eos_token }}",
                 special);
  const auto req = nlohmann::ordered_json::parse(R"({"messages": [{"role": "user", "content": "hi"}],
                                                     "add_generation_prompt": true})");
  EXPECT_EQ(t.render(req), "<s>[user:hi]no tools></s>");
  EXPECT_EQ(*t.eos_token(), "</s>");
  EXPECT_NE(error_of([&] { t.render(nlohmann::ordered_json::parse(R"({"msgs": []})")); }).find("messages"),
            std::string::npos);
}

}  // namespace
}  // namespace dflash

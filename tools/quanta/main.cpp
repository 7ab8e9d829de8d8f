// quanta: the command-line tool. Exit codes: 0 success, 1 runtime failure
// (bad file, failed run), 2 usage error (bad flag, unknown subcommand).
#include <iostream>
#include <string>

#include "commands.h"
#include "quanta_config.h"
#include "wait_policy.h"

namespace {

// One line on stderr, however the message was built.
int fail(const std::string& what, int code) {
  std::string line = what;
  for (char& c : line)
    if (c == '\n' || c == '\r') c = ' ';
  std::cerr << "quanta: error: " << line << "\n";
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  quanta::cli::adopt_wait_policy(argv);  // may start this process again
  CLI::App app{"quanta: a C++ deep-learning engine for vector-quantized and NF4 models"};
  app.name("quanta");
  app.set_version_flag("--version", std::string("quanta ") + QUANTA_VERSION);
  quanta::cli::add_train(app);
  quanta::cli::add_eval(app);
  quanta::cli::add_generate(app);
  quanta::cli::add_tokenize(app);
  quanta::cli::add_encode(app);
  quanta::cli::add_decode(app);
  quanta::cli::add_inspect(app);
  quanta::cli::add_bench(app);
  quanta::cli::add_parity(app);
  quanta::cli::add_quantize(app);
  quanta::cli::add_finetune(app);
  quanta::cli::add_merge(app);
  quanta::cli::add_launch(app);
  // CLI11 would call an unknown word "an argument not expected": say it is not
  // a subcommand and list the real ones.
  if (argc > 1 && argv[1][0] != '-') {
    std::string names;
    bool known = false;
    const CLI::App& root = app;
    for (const CLI::App* sub : root.get_subcommands([](const CLI::App*) { return true; })) {
      names += (names.empty() ? "" : ", ") + sub->get_name();
      known = known || sub->get_name() == argv[1];
    }
    if (!known)
      return fail(std::string("unknown subcommand '") + argv[1] + "' (subcommands: " + names +
                      "; see quanta --help)",
                  2);
  }
  try {
    app.parse(argc, argv);
    // Checked here rather than with require_subcommand, which would hide a
    // misspelt flag behind "a subcommand is required".
    if (app.get_subcommands().empty()) throw quanta::cli::UsageError("a subcommand is required");
  } catch (const CLI::ParseError& e) {
    // --help and --version arrive as "errors" with exit code 0.
    if (e.get_exit_code() == 0) return app.exit(e);
    return fail(std::string(e.what()) + " (see quanta --help)", 2);
  } catch (const quanta::cli::UsageError& e) {
    return fail(std::string(e.what()) + " (see quanta --help)", 2);
  } catch (const std::exception& e) {
    return fail(e.what(), 1);
  }
  return 0;
}

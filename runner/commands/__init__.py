"""The command line and what it prints: `aot run`, `aot inspect`, `aot diff`, the console's
one-line errors and the formatting `aot build` shares. May import every other part of the runner."""

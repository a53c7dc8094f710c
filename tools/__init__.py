"""Command-line front doors: each parses arguments, calls the engine and prints results."""

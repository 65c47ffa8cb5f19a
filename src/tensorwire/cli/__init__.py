"""Command-line interface: argument parsing, logging set-up and exit codes only."""

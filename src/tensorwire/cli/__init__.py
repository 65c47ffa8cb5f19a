"""Command-line interface: argument parsing, logging set-up and exit codes only.

What a command does lives below it: the servers and their process plumbing in ``tensorwire.service``, what the
demos and ``fetch`` measure and print in ``tensorwire.bench``, the soak in ``tensorwire.soak``.
"""

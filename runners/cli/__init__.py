"""The ``dsv4`` command line: ``run``, ``explain``, ``matrix``, ``bench``, ``init-checkpoint``.

Contract (DESIGN §7): every command accepts ``--json`` and then prints exactly one JSON object on
stdout; errors go to stderr as one line with a non-zero exit, never a bare traceback. The console
entry point is ``dsv4_cli:main`` (a light module that turns Ctrl-C at any moment, start-up
imports included, into one line); it calls ``runners.cli.main.main``. Each command lives in its
own module.
"""

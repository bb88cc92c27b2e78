"""The ``dsv4`` command line: ``run``, ``explain``, ``matrix``, ``bench``, ``init-checkpoint``.

Contract (DESIGN §7): every command accepts ``--json`` and then prints exactly one JSON object on
stdout; errors go to stderr as one line with a non-zero exit, never a bare traceback. The entry
point is ``runners.cli.main:main``; each command lives in its own module.
"""
